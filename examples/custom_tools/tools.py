"""A function tool: typed arguments and a Google-style docstring are all unison needs for its schema."""
from __future__ import annotations

from staff import STAFF


def badge_number(person: str) -> str:
    """Look up the badge number of a member of staff.

    Args:
        person: the person's full name, as in "Ada Pelk"
    """
    record = STAFF.get(person.strip())
    if record is None:
        raise KeyError(f"no member of staff named {person!r}")
    return record["badge"]
