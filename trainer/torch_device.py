"""The check every command that trains on a torch device runs first: the device names one that exists
on this machine (``fedroute simulate --device``, ``fedroute mor grpo --device``, ``fedroute prism dpo
--gpu``), so a CPU-only machine refuses ``cuda`` before any data is read or any file is written."""

from __future__ import annotations

from sdk.errors import InvalidInputError


def check_torch_device(option: str, device: str) -> None:
    """Refuse a torch device string that does not parse or that this machine lacks.

    Parameters
    ----------
    option : the command-line option that gave it, named in the message (e.g. ``"--device"``).
    device : a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"mps"``).

    Raises
    ------
    InvalidInputError
        Not a torch device, or a CUDA device while torch sees none (CPU-only build or no GPU).
    """
    import torch  # torch: optional heavy dependency (trainer extra), imported on use

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise InvalidInputError(f"{option} {device!r} is not a torch device (cpu, cuda, cuda:1, mps)") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError(f"{option} {device!r}: torch sees no CUDA device (CPU-only build or no GPU)")
