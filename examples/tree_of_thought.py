"""Tree of thought with fork: branches share the question's prefix (and its KV cache), run in
parallel, and are joined before the answer.

    python examples/tree_of_thought.py [--url http://127.0.0.1:30000]
"""

from common import setup_backend

import treespec as ts


@ts.function
def tree_of_thought(s, question, n=3):
    s += ts.user(question)
    forks = s.fork(n)
    for i, f in enumerate(forks):
        f += ts.assistant(f"Approach {i + 1}: " + ts.gen("plan", max_tokens=24, temperature=0.8, seed=i))
        f += ts.user("Is this approach good? Answer yes or no.")
        f += ts.assistant(ts.select("verdict", choices=["yes", "no"]))
    forks.join()
    plans = "\n".join(f"{i + 1}. {f['plan'].strip()} (judged: {f['verdict']})" for i, f in enumerate(forks))
    s += ts.user(f"Here are some approaches:\n{plans}\nUsing the best one, answer briefly.")
    s += ts.assistant(ts.gen("answer", max_tokens=48))


if __name__ == "__main__":
    setup_backend(__doc__)
    state = tree_of_thought.run(question="How can I learn to cook quickly?", temperature=0)
    print(state.messages()[-2]["content"])
    print("\nAnswer:", state["answer"])
