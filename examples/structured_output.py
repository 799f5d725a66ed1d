"""Structured output in a program: a field matched by a regex, a record valid against a JSON schema, and a
choice among fixed strings; the engine enforces each (grammar-constrained decoding).

    python examples/structured_output.py [--url http://127.0.0.1:30000]
"""

import json

from common import setup_backend

import treespec as ts

BOOK = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60},
                                        "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                                        "genres": {"type": "array", "items": {"type": "string", "maxLength": 20},
                                                   "maxItems": 3}},
        "required": ["title", "year", "genres"], "additionalProperties": False}


@ts.function
def catalogue(s, book):
    s += ts.user(f"Describe the book {book} as JSON with its title, year and genres.")
    s += ts.assistant(ts.gen("record", json_schema=BOOK, max_tokens=120))
    s += ts.user("Give its ISBN-13.")
    s += ts.assistant(ts.gen("isbn", regex=r"97[89]-\d-\d{3}-\d{5}-\d", max_tokens=24))
    s += ts.user("Is it fiction?")
    s += ts.assistant(ts.gen("fiction", choices=["Yes", "No"]))


if __name__ == "__main__":
    setup_backend(__doc__)
    for state in catalogue.run_batch([{"book": b} for b in ("Moby-Dick", "A Brief History of Time")],
                                     temperature=0):
        print(json.loads(state["record"]), state["isbn"], "fiction:", state["fiction"])
