"""tqdm progress bars (with ETA) for the converter's passes, silenced with enable=False."""

from __future__ import annotations

import sys

from tqdm import tqdm


def bar(total: int, desc: str, unit: str = "it", enable: bool = True, initial: int = 0) -> tqdm:
    return tqdm(total=total, desc=desc, unit=unit, disable=not enable, initial=initial, file=sys.stderr,
                dynamic_ncols=True, leave=True)  # fmt: skip
