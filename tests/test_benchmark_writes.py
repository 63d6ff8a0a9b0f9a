"""Every results file a benchmark writes (JSON, markdown, PNG under ``--out`` or ``docs/``) goes through an atomic
writer (:mod:`trainer.report`'s ``write_text`` / ``write_json`` / ``save_figure``, or
:func:`sdk.atomic_write.write_atomic`), so a killed run leaves the previous results file, never a truncated one that
the docs cite. The scan is of the scripts' syntax trees: each direct file write (``Path.write_text``/``write_bytes``,
``Figure.savefig``, ``json.dump``/``pickle.dump``/``np.save``, ``open``/``Path.open`` for writing) must be one of the
scratch files listed here, which live in a benchmark's temporary work folder and are not results."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

# (script, the write as ast.unparse writes it): scratch files in a temporary work folder, read back by the run itself.
SCRATCH_WRITES = {
    ("proxy_latency.py", "(work / 'proxy.json').write_text"),  # the proxy's config, in its work folder
    ("proxy_latency.py", "(work / 'tokens').write_text"),  # the proxy's token file, in its work folder
    ("proxy_latency.py", "open(work / 'processes.log', 'w')"),  # child processes' log, in the work folder
    ("sync_load.py", "self.log_path.open('ab')"),  # a server process's log, in the work folder
    ("proxy_attacks.py", "(work / 'proxy.json').write_text"),  # the proxy's config, in its work folder
    ("proxy_attacks.py", "(work / 'tokens').write_text"),  # the proxy's token file, in its work folder
    ("proxy_attacks.py", "open(work / 'stub.log', 'w')"),  # the stub upstream's log, in the work folder
    ("proxy_attacks.py", "open(log_path, 'w')"),  # the proxy's log, read back by the run for tracebacks
}

ATTR_WRITES = {"write_text", "write_bytes", "savefig"}
ATOMIC_MODULES = {"report", "trainer.report"}  # report.write_text(path, text) is the atomic writer
MODULE_WRITES = {("json", "dump"), ("pickle", "dump"), ("np", "save"), ("np", "savez"), ("numpy", "save")}


def _is_write_mode(call: ast.Call, position: int) -> bool:
    mode = call.args[position] if len(call.args) > position else next(
        (k.value for k in call.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and isinstance(mode.value, str) and any(c in mode.value for c in "wax+")


def direct_writes(source: str) -> list[str]:
    """The file writes in ``source`` that bypass the atomic writers, as source text."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in ATTR_WRITES
                and ast.unparse(func.value) not in ATOMIC_MODULES):
            found.append(ast.unparse(func))
        elif (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name)
              and (func.value.id, func.attr) in MODULE_WRITES):
            found.append(ast.unparse(func))
        elif isinstance(func, ast.Name) and func.id == "open" and _is_write_mode(node, 1):
            found.append(ast.unparse(node))
        elif isinstance(func, ast.Attribute) and func.attr == "open" and _is_write_mode(node, 0):
            found.append(ast.unparse(node))
    return found


def test_the_scan_sees_each_kind_of_direct_write():
    src = ('(args.out / "x.json").write_text(s)\nfig.savefig(path, dpi=120)\njson.dump(d, f)\n'
           'open(p, "w")\np.open(mode="wb")\nopen(p)\np.open("rb")\nwrite_text(args.out / "x.md", s)\n'
           'report.write_text(args.out / "x.md", s)\nsave_figure(fig, path)\n')
    assert direct_writes(src) == ["(args.out / 'x.json').write_text", "fig.savefig", "json.dump",
                                  "open(p, 'w')", "p.open(mode='wb')"]


def test_benchmarks_write_results_atomically():
    unexpected = [(path.name, write) for path in sorted(BENCHMARKS.glob("*.py"))
                  for write in direct_writes(path.read_text()) if (path.name, write) not in SCRATCH_WRITES]
    assert unexpected == []


def test_the_scratch_allowlist_is_current():
    """A scratch write that is gone (or renamed) is dropped from the list, so the list never covers a results file."""
    present = {(path.name, write) for path in BENCHMARKS.glob("*.py") for write in direct_writes(path.read_text())}
    assert SCRATCH_WRITES <= present
