"""Write the example's questions and corpus beside this file: half the questions ask for a badge number (only
badge_number knows it), half for a room (only the directory server's room_of knows it); the corpus says which team each
person is in, and nothing the questions ask."""
from __future__ import annotations

import json
import random
from pathlib import Path

from staff import STAFF

HERE = Path(__file__).parent


def main() -> None:
    rng = random.Random(0)
    rows = []
    for k, (name, record) in enumerate(sorted(STAFF.items())):
        if k % 2 == 0:
            rows.append({"question": f"What is the badge number of {name}?", "answers": [record["badge"]]})
        else:
            rows.append({"question": f"Which room does {name} work in?", "answers": [record["room"], f"room {record['room']}"]})
    rng.shuffle(rows)
    with open(HERE / "questions.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with open(HERE / "corpus.jsonl", "w") as f:
        for k, (name, record) in enumerate(sorted(STAFF.items())):
            f.write(json.dumps({"id": str(k), "title": name, "text": f"{name} works in the {record['team']} team."}) + "\n")
    print(f"{len(rows)} questions, {len(STAFF)} passages in {HERE}")


if __name__ == "__main__":
    main()
