"""Writes tests/data/router_labeled.jsonl: hand-written short prompts plus long-context prompts.

The long-context rows wrap an instruction around a long synthetic document built
deterministically from the sentence pool below (a real user would paste a report, a log, a
contract). Run once; the .jsonl is what the tests read.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).parent

POOL = [
    "The quarterly report shows revenue grew in every region except the northeast.",
    "2024-03-02 14:11:07 INFO worker-3 processed batch 1182 in 412 ms.",
    "The tenant shall pay the rent on the first day of each calendar month.",
    "Customer satisfaction scores dipped slightly after the pricing change in April.",
    "Section 4.2: either party may terminate this agreement with thirty days written notice.",
    "2024-03-02 14:11:09 WARN worker-1 retrying connection to db-primary (attempt 2).",
    "The committee reviewed the proposal and requested additional cost estimates.",
    "Field trials in the southern plots produced yields twelve percent above the baseline.",
    "The new onboarding flow reduced drop-off during account creation by a third.",
    "Maintenance of the shared areas is the responsibility of the landlord.",
    "Participants reported fewer symptoms after the second week of treatment.",
    "The migration script skipped records whose timestamps were missing.",
]

INSTRUCTIONS = [
    "Summarize the following report in five bullet points.",
    "Here is our full server log from last night. What went wrong?",
    "Read this contract and tell me whether I can terminate early.",
    "Below is the transcript of a long meeting. List the decisions that were made.",
    "Answer using only the document below: what happened to yields in the southern plots?",
    "Translate the key findings of this long study into plain language.",
    "I'm pasting an entire chapter. Find every place where the tone becomes negative.",
    "Go through this whole document and extract every date and amount.",
    "Here are all of our customer interviews. What themes come up most often?",
    "Review this long design document and point out inconsistencies.",
    "Based on the full text below, write a FAQ with ten questions and answers.",
    "Compare the first half and the second half of this document.",
    "This is the complete incident timeline. Reconstruct the root cause.",
    "Classify each paragraph of the following document by topic.",
    "Proofread the whole text below and list any errors.",
    "Here is a long codebase dump. Explain how the modules fit together.",
]


def long_document(rng: random.Random, sentences: int) -> str:
    return "\n".join(rng.choice(POOL) for _ in range(sentences))


def main() -> None:
    rng = random.Random(7)
    rows = []
    for line in (HERE / "router_short.tsv").read_text().splitlines():
        task, prompt = line.split("\t", 1)
        rows.append({"task": task, "messages": [{"role": "user", "content": prompt.replace("\\n", "\n")}]})
    for instruction in INSTRUCTIONS:
        doc = long_document(rng, rng.randint(160, 320))
        rows.append({"task": "long-context", "messages": [{"role": "user", "content": f"{instruction}\n\n{doc}"}]})
    with open(HERE / "router_labeled.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
