"""Write the golden sample files for the current format version (run once per new version).

python scripts/make_golden.py            # writes tests/data/v<format>/<kind>.spilld, never overwrites
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import spilld
from spilld import format as fmt
from tests.golden_cases import GOLDEN, GOLDEN_TOKENS


def main() -> None:
    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", f"v{fmt.FORMAT_VERSION}"
    )
    os.makedirs(root, exist_ok=True)
    for kind, build in GOLDEN.items():
        path = os.path.join(root, f"{kind}.spilld")
        if os.path.exists(path):
            print(f"keep  {path}")
            continue
        ident = spilld.Identity("golden", "fp-golden", "tok-golden", "ns")
        spilld.save(path, GOLDEN_TOKENS, build(), {"case": kind}, identity=ident)
        print(f"wrote {path} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
