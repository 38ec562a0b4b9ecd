"""The staff of a made-up company, the data behind the example's two tools: each person's badge number (the function
tool, tools.py) and room (the MCP server, directory_server.py). Neither is in the search corpus, so only the tools
can answer questions about them (make_dataset.py)."""
from __future__ import annotations

import random

FIRST = ["Ada", "Bram", "Cleo", "Dov", "Elin", "Fenn", "Gita", "Hale", "Ines", "Joss", "Kira", "Lior", "Mara", "Niko"]
LAST = ["Pelk", "Quist", "Rask", "Sorell", "Tamm", "Ulvik", "Vance", "Wexley", "Yarrow", "Zeller"]
TEAMS = ["billing", "search", "hardware", "support", "legal"]


def staff(n: int = 40, seed: int = 7) -> dict[str, dict]:
    """name -> {badge, room, team}, the same for the same seed."""
    rng = random.Random(seed)
    names = sorted({f"{rng.choice(FIRST)} {rng.choice(LAST)}" for _ in range(n * 3)})[:n]
    out = {}
    for name in names:
        out[name] = {"badge": f"B-{rng.randint(1000, 9999)}", "room": f"{rng.randint(1, 9)}.{rng.randint(10, 40)}",
                     "team": rng.choice(TEAMS)}
    return out


STAFF = staff()
