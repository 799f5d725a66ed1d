"""Few-shot QA over a batch of questions with run_batch: every program shares the few-shot prefix,
which the radix cache serves once for all of them.

    python examples/few_shot_qa.py [--url http://127.0.0.1:30000]
"""

from common import setup_backend

import treespec as ts

EXAMPLES = [("France", "Paris"), ("Japan", "Tokyo"), ("Kenya", "Nairobi"), ("Peru", "Lima"), ("Canada", "Ottawa")]
FEW_SHOT = "".join(f"Question: What is the capital of {c}?\nAnswer: {cap}\n\n" for c, cap in EXAMPLES)


@ts.function
def few_shot_qa(s, country):
    s += FEW_SHOT + f"Question: What is the capital of {country}?\nAnswer:"
    s += ts.gen("answer", max_tokens=8, stop="\n")


if __name__ == "__main__":
    setup_backend(__doc__)
    countries = ["Italy", "Spain", "Germany", "Egypt", "Norway", "Greece", "Poland", "Cuba"]
    states = few_shot_qa.run_batch([{"country": c} for c in countries], temperature=0, progress_bar=True)
    for country, state in zip(countries, states, strict=True):
        if state.error is not None:
            print(f"{country:8} ERROR {state.error!r}")
            continue
        meta = state.get_meta_info("answer")
        print(f"{country:8} ->{state['answer']:14} (prompt {meta['prompt_tokens']} tokens, "
              f"{meta['cached_tokens']} from the cache)")
