"""Write the generated records block of r3_cache.proto (see r3_client/_answer_forms.py).

``python scripts/gen_proto.py`` rewrites the block; ``--check`` exits 1 if it is stale.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from r3_client.wire import PROTO_MESSAGES, proto_messages

PROTO = Path(__file__).resolve().parents[1] / "clients" / "r3_client" / "_proto" / "r3_cache.proto"
BLOCK = re.compile(
    r"(// BEGIN GENERATED records[^\n]*\n(?://[^\n]*\n)*)(.*?)(// END GENERATED records)", re.S
)


def render(text: str) -> str:
    """``text`` with the generated block rewritten from the dataclasses."""
    if not BLOCK.search(text):
        raise SystemExit(f"{PROTO}: no BEGIN/END GENERATED records markers")
    return BLOCK.sub(lambda m: m.group(1) + proto_messages(PROTO_MESSAGES) + m.group(3), text)


def main() -> int:
    text = PROTO.read_text()
    new = render(text)
    if "--check" in sys.argv[1:]:
        if new != text:
            print(f"{PROTO} is stale: run scripts/gen_proto.sh", file=sys.stderr)
            return 1
        return 0
    PROTO.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
