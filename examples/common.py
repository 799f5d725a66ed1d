"""Shared by the examples: pick the backend (a running server with --url, else an in-process Engine)."""

from __future__ import annotations

import argparse

from treespec.lang import EngineBackend, RuntimeEndpoint, set_default_backend


def setup_backend(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--url", default=None, help="a running launch_server, e.g. http://127.0.0.1:30000 "
                                                    "(default: start an in-process Engine on the default model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model-path", default=None, help="model for the in-process Engine")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads of the in-process Engine")
    args = parser.parse_args()
    if args.url:
        set_default_backend(RuntimeEndpoint(args.url, api_key=args.api_key))
    else:
        from treespec.engine import Engine

        set_default_backend(EngineBackend(Engine(args.model_path, num_threads=args.num_threads)))
    return args
