"""Release numbers of torch, for rules that hold from or until a release."""

import re

import torch


def release(torch_version: str = torch.__version__) -> tuple[int, ...]:
    """``"2.14.1+cu130"`` as ``(2, 14, 1)``; pre-release and local tags are dropped."""
    numbers = torch_version.split("+")[0].split(".")[:3]
    return tuple(int(re.match(r"\d*", n).group() or 0) for n in numbers)
