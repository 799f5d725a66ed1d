"""A multi-turn chat with roles, rendered through the model's chat template; streams the last turn.

    python examples/multi_turn_chat.py [--url http://127.0.0.1:30000]
"""

from common import setup_backend

import treespec as ts


@ts.function
def chat(s, first, second):
    s += ts.system("You are a helpful assistant. Answer in one short sentence.")
    s += ts.user(first)
    s += ts.assistant(ts.gen("answer1", max_tokens=32))
    with s.user():
        s += second
    with s.assistant():
        s += ts.gen("answer2", max_tokens=32)


if __name__ == "__main__":
    setup_backend(__doc__)
    state = chat.run(first="What is the capital of France?", second="What is a famous museum there?",
                     temperature=0)
    for m in state.messages():
        print(f"[{m['role']}] {m['content']}")
    print("\n--- the same program, streamed ---")
    stream = chat.run(first="Name a planet.", second="How far is it from the Sun?", temperature=0, stream=True)
    for delta in stream.text_iter():
        print(delta, end="", flush=True)
    print()
