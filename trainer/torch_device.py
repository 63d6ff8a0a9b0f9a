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


#: torch CPU threads of ``fedroute simulate`` / ``ablate`` and ``fedroute mor ...`` unless ``--threads`` says
#: otherwise: their models are small (the MLP router is 384 -> 128 -> 2 x 11), and on a busy 2-core machine
#: two threads trained it 11-14x slower than one (``benchmarks/torch_threads.py``, docs/benchmarks.md).
DEFAULT_CPU_THREADS = 1


def set_cpu_threads(threads: int) -> None:
    """Set torch's intra-op CPU threads for this process (``torch.set_num_threads``).

    Raises
    ------
    InvalidInputError
        ``threads`` is not an int >= 1.
    """
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise InvalidInputError(f"threads must be an int >= 1, got {threads!r}")
    import torch  # torch: optional heavy dependency (trainer extra), imported on use

    torch.set_num_threads(threads)
