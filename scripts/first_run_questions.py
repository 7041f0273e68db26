#!/usr/bin/env python3
"""The five everyday questions of a first run (issue 30) and their checks; standard library
only, as a new user's machine has. Shared by scripts/first_run.sh (which asks a running server)
and scripts/fixtures/first_run_fixtures.py (which asks llama.cpp, the oracle).

    python3 scripts/first_run_questions.py http://127.0.0.1:8080

asks the server each question at temperature 0 and checks each answer and that it stopped by
itself (finish_reason "stop", not the token limit); exits non-zero if any check fails.
"""
import json
import re
import sys
import urllib.request


def haiku(a):
    """Three lines, not one line three times (punctuation and case aside)."""
    lines = [re.sub(r"[^\w\s]", "", line).strip().lower() for line in a.splitlines() if line.strip()]
    return len(lines) == 3 and len(set(lines)) > 1


# (question, what is expected, check of the answer's text)
QUESTIONS = [
    ("What is the capital of France?", "mentions Paris", lambda a: "paris" in a.lower()),
    ("What is 17 × 23?", "391", lambda a: re.search(r"(?<![\d,.])391(?![\d,])", a) is not None),
    ("Write a haiku about the sea.", "three different lines", haiku),
    ("Write a one-line Python function that returns the square of a number.", "a def or a lambda",
     lambda a: "def " in a or "lambda" in a),
    ('Translate "good morning" to Spanish.', "Buenos días", lambda a: "buenos días" in a.lower()),
]


def ask(url, question):
    body = {"messages": [{"role": "user", "content": question}], "temperature": 0}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def main(url):
    failed = 0
    for question, expected, check in QUESTIONS:
        out = ask(url, question)
        choice = out["choices"][0]
        answer = choice["message"]["content"] or ""
        ok = check(answer) and choice["finish_reason"] == "stop"
        failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {question}\n     expected {expected}; finish_reason "
              f"{choice['finish_reason']}, {out['usage']['completion_tokens']} tokens\n     "
              + answer.replace("\n", "\n     "))
    print(f"first run: {len(QUESTIONS) - failed} of {len(QUESTIONS)} answers right")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
