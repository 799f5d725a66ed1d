"""Classification with select: each label is scored by the length-normalised log-probability of its
tokens after the prompt, and the best one is picked (no sampling).

    python examples/classification.py [--url http://127.0.0.1:30000]
"""

from common import setup_backend

import treespec as ts

LABELS = [" positive", " negative", " neutral"]  # the space belongs to the label's token


@ts.function
def classify(s, review):
    s += ts.user(f"Classify the sentiment of this review as positive, negative or neutral.\nReview: {review}")
    s += ts.assistant("Sentiment:" + ts.select("label", choices=LABELS))


if __name__ == "__main__":
    setup_backend(__doc__)
    reviews = ["An absolute masterpiece, I loved every minute.", "Terrible food and rude staff. Never again.",
               "It arrived on Tuesday in a cardboard box.", "The best purchase I have made this year!"]
    for review, state in zip(reviews, classify.run_batch([{"review": r} for r in reviews]), strict=True):
        scores = state.get_meta_info("label")["normalized_logprobs"]
        print(f"{state['label'].strip():>8}  {dict(zip((x.strip() for x in LABELS), (round(x, 2) for x in scores), strict=True))}  {review}")
