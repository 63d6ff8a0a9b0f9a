"""The ``fedroute`` / ``fedroute-sync`` command lines that README.md and docs/*.md tell a user to run (fenced
shell blocks and inline code spans), and those in the module docstrings of benchmarks/ and examples/, name
sub-commands that exist and options that those sub-commands take, with no more positional words than they accept.

Nothing is executed: each line is resolved against the click command tree of the console scripts'
typer apps (the entry points of pyproject.toml's ``[project.scripts]``; ``python -m <module>`` of an entry
point's module is the same command), so the test takes about a second.
"""

from __future__ import annotations

import ast
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from typer.main import get_command

from sdk.sync_cli import make_app as make_sync_app
from trainer.cli import app as fedroute_app

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: scripts whose module docstrings show command lines (``fedroute simulate ...`` before a benchmark, say)
SCRIPTS = sorted([*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "examples").glob("*.py")])

#: console script -> its click command. Keyed by the entry point so that a changed [project.scripts] fails
#: test_the_console_scripts_are_the_apps_checked_here instead of being checked against the wrong app.
ENTRY_POINTS = {"trainer.cli:main": lambda: get_command(fedroute_app),
                "sdk.sync_cli:main": lambda: get_command(make_sync_app())}

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}
CODE_SPAN = re.compile(r"`([^`\n]+)`")
RST_LITERAL = re.compile(r"``([^`\n]+)``")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
#: ``train|eval|audit`` (no spaces): alternatives in prose, not a pipe
ALTERNATIVES = re.compile(r"(?<![\w|-])([a-z][\w-]*(?:\|[a-z][\w-]*)+)(?![\w|-])")
OPERATOR = re.compile(r"^[();<>|&]+$")
#: a docstring line that is a command (``VAR=value`` words first, then fedroute, fedroute-sync or python -m)
COMMAND_START = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:fedroute(?:-sync)?|python3? -m)\s")


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: script name -> ``module:function``."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def commands() -> dict[str, click.Command]:
    """Script name, and ``python -m`` of its module (``python -m trainer.cli ...`` is ``fedroute ...``) -> its
    click command (a group for ``fedroute``)."""
    found = {}
    for name, target in console_scripts().items():
        if target in ENTRY_POINTS:
            found[name] = found[f"python -m {target.split(':')[0]}"] = ENTRY_POINTS[target]()
    return found


@dataclass(frozen=True)
class DocLine:
    """One documented command line: where it is (``page:line``) and its words (from the program on)."""

    where: str
    words: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {' '.join(self.words)}"


def _expand_alternatives(text: str) -> list[str]:
    """``fedroute mor train|eval|audit`` -> one line per alternative (the first ``a|b`` group at a time)."""
    m = ALTERNATIVES.search(text)
    if m is None:
        return [text]
    return [out for alt in m[1].split("|") for out in _expand_alternatives(text[:m.start(1)] + alt + text[m.end(1):])]


def shell_commands(text: str, programs: set[str]) -> list[tuple[str, ...]]:
    """The simple commands of ``text`` (shell, one logical line) that run one of ``programs``: split at
    ``&&``, ``;``, ``|``, ``&``, ``$(``, ``)``, redirections; comments dropped; leading ``VAR=value``
    words and ``{`` skipped; a ``python -m M`` start is joined into the one word ``python -m M``."""
    lexer = shlex.shlex(text.replace("$(", " ( "), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote in prose
        return []
    segments, current = [], []
    for token in tokens:
        if OPERATOR.match(token):
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    found = []
    for words in segments:
        while words and (ENV_ASSIGNMENT.match(words[0]) or words[0] == "{"):
            words = words[1:]
        if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m":
            words = [f"python -m {words[2]}", *words[3:]]
        if words and words[0] in programs:
            found.append(tuple(words))
    return found


def documented_lines(page: Path, programs: set[str], root: Path = ROOT) -> list[DocLine]:
    """Every command line of ``page`` that runs one of ``programs``: in fenced shell blocks (backslash
    continuations joined) and in inline code spans outside them; named by ``page``'s path under ``root``."""
    text = page.read_text()
    name = page.relative_to(root)
    lines = []
    for fence in FENCE.finditer(text):
        if fence[1].strip() not in SHELL_FENCES:
            continue
        first = text.count("\n", 0, fence.start(2)) + 1
        body = fence[2]
        for logical in re.finditer(r"(?:[^\n]*\\\n)*[^\n]*", body):
            line_no = first + body.count("\n", 0, logical.start())
            for variant in _expand_alternatives(logical[0].replace("\\\n", " ")):
                lines += [DocLine(f"{name}:{line_no}", w) for w in shell_commands(variant, programs)]
    outside = FENCE.sub(lambda m: "\n" * m[0].count("\n"), text)
    for span in CODE_SPAN.finditer(outside):
        if span[1].startswith(('"', "'")):  # a quoted string (a model name such as "fedroute"), not a command
            continue
        line_no = outside.count("\n", 0, span.start()) + 1
        for variant in _expand_alternatives(span[1]):
            lines += [DocLine(f"{name}:{line_no}", w) for w in shell_commands(variant, programs)]
    return lines


def docstring_lines(script: Path, programs: set[str], root: Path = ROOT) -> list[DocLine]:
    """The command lines of ``script``'s module docstring: its literal lines (backslash continuations
    joined) that start with one of ``programs``, and its ````...```` spans."""
    tree = ast.parse(script.read_text())
    doc = ast.get_docstring(tree) or ""
    first = tree.body[0].lineno if doc else 0
    name = script.relative_to(root)
    lines = []
    for logical in re.finditer(r"(?:[^\n]*\\\n)*[^\n]*", doc):
        line_no = first + doc.count("\n", 0, logical.start())
        text = logical[0].replace("\\\n", " ").strip()
        if COMMAND_START.match(text):
            lines += [DocLine(f"{name}:{line_no}", w) for w in shell_commands(text, programs)]
        for span in RST_LITERAL.finditer(logical[0]):
            lines += [DocLine(f"{name}:{line_no}", w) for v in _expand_alternatives(span[1]) for w in shell_commands(v, programs)]
    return lines


def problems(line: DocLine, roots: dict[str, click.Command]) -> list[str]:
    """What is wrong with ``line``: an unknown sub-command, a group given options, unknown options, more
    positional words than the command takes. ``...`` stands for omitted words; ``[--opt VALUE]`` marks an
    optional part."""
    command, path = roots[line.words[0]], [line.words[0]]
    rest = [w.strip("[]") for w in line.words[1:]]
    rest = [w for w in rest if w]
    while isinstance(command, click.Group) and rest and not rest[0].startswith("-") and rest[0] != "...":
        sub = command.commands.get(rest[0])
        if sub is None:
            return [f"`{' '.join(path)}` has no sub-command {rest[0]!r} (it has {sorted(command.commands)})"]
        command, path, rest = sub, [*path, rest[0]], rest[1:]
    name = " ".join(path)
    if isinstance(command, click.Group):
        if not rest or rest[0] == "...":
            return []
        return [f"`{name}` is a group: give one of its sub-commands {sorted(command.commands)}"]
    options = {o: p for p in command.params if isinstance(p, click.Option) for o in [*p.opts, *p.secondary_opts]}
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    room = float("inf") if any(a.nargs < 0 for a in arguments) else sum(a.nargs for a in arguments)
    found, positional, words = [], 0, iter(rest)
    for word in words:
        if word == "...":
            positional = float("-inf")  # omitted words: the count is unknown
        elif word.startswith("-") and word != "-":
            flag, _, value = word.partition("=")
            param = options.get(flag)
            if flag == "--help":
                continue
            if param is None:
                found.append(f"`{name}` has no option {flag} (it has {sorted(options)})")
                positional = float("-inf")  # whether it takes a value is unknown
            elif not (param.is_flag or param.count or value):
                next(words, None)  # the option's value
        else:
            positional += 1
    if positional > room:
        found.append(f"`{name}` takes {room} positional argument(s), the line gives {positional}: {rest}")
    return found


ROOTS = commands()
LINES = [line for page in PAGES for line in documented_lines(page, set(ROOTS))]
SCRIPT_LINES = [line for script in SCRIPTS for line in docstring_lines(script, set(ROOTS))]


def test_the_console_scripts_are_the_apps_checked_here():
    """pyproject.toml's console scripts are the ones this test resolves lines against (a new or moved
    entry point must be added to ENTRY_POINTS, not silently skipped)."""
    scripts = console_scripts()
    assert set(scripts.values()) <= set(ENTRY_POINTS), scripts
    assert {"fedroute", "fedroute-sync", "python -m trainer.cli", "python -m sdk.sync_cli"} <= set(ROOTS)
    assert ROOTS["python -m trainer.cli"] is ROOTS["fedroute"]


def test_the_extraction_on_a_hand_written_page(tmp_path):
    """Continuations, comments, env prefixes, ``$(...)``, pipes, ``{ ...; }``, optional ``[--x]`` parts,
    inline spans with ``...`` and ``a|b`` alternatives; python code blocks and non-commands are left out."""
    page = tmp_path / "page.md"
    page.write_text(
        "Run `fedroute mor train|eval --quick` or `fedroute export ... --int8`, not `fedroute:lam=1` or `~/.cache/fedroute`.\n"
        "```bash\n"
        "HF_HUB_OFFLINE=1 fedroute simulate --data d \\\n"
        "    --out r   # a comment --not-an-option\n"
        "f() { fedroute-sync --server s --log l; }\n"
        "X=$(fedroute keygen --out k) && cat k | fedroute rounds close --db d > log 2>&1 & P=$!\n"
        "PYTHONPATH=. python -m trainer.cli prism train [--quick] --seeds 1\n"
        "```\n"
        "```python\nfedroute simulate --bogus\n```\n")
    got = [(line.where, line.words) for line in documented_lines(page, set(ROOTS), root=tmp_path)]
    assert got == [
        ("page.md:3", ("fedroute", "simulate", "--data", "d", "--out", "r")),
        ("page.md:5", ("fedroute-sync", "--server", "s", "--log", "l")),
        ("page.md:6", ("fedroute", "keygen", "--out", "k")),
        ("page.md:6", ("fedroute", "rounds", "close", "--db", "d")),
        ("page.md:7", ("python -m trainer.cli", "prism", "train", "[--quick]", "--seeds", "1")),
        ("page.md:1", ("fedroute", "mor", "train", "--quick")),
        ("page.md:1", ("fedroute", "mor", "eval", "--quick")),
        ("page.md:1", ("fedroute", "export", "...", "--int8")),
    ]


def test_the_extraction_on_a_hand_written_docstring(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text('"""Make the input with ``fedroute simulate --seeds 1``, then::\n\n'
                      '    HF_HUB_OFFLINE=1 fedroute export --router r \\\\\n        --out b\n    python bench.py --x\n"""\n')
    got = [(line.where, line.words) for line in docstring_lines(script, set(ROOTS), root=tmp_path)]
    assert got == [("bench.py:1", ("fedroute", "simulate", "--seeds", "1")),
                   ("bench.py:3", ("fedroute", "export", "--router", "r", "--out", "b"))]


@pytest.mark.parametrize("words, expected", [
    (("fedroute", "simulate", "--data", "d", "--seeds", "1"), []),
    (("fedroute", "prism", "..."), []),
    (("fedroute", "rounds", "close", "--round=3"), []),
    (("fedroute-sync", "--server", "s", "[--ca-cert", "c]"), []),
    (("fedroute", "simulate", "--n-client", "3"), ["`fedroute simulate` has no option --n-client"]),
    (("fedroute", "round", "close"), ["`fedroute` has no sub-command 'round'"]),
    (("fedroute", "rounds", "--db", "d"), ["`fedroute rounds` is a group: give one of its sub-commands"]),
    (("fedroute-sync", "sync", "--server", "s"), ["`fedroute-sync` takes 0 positional argument(s)"]),
    (("fedroute", "clients", "add", "phone-1", "--db", "d"), []),
    (("fedroute", "keygen", "--force", "keys"), ["`fedroute keygen` takes 0 positional argument(s)"]),
])
def test_problems_on_hand_written_lines(words, expected):
    found = problems(DocLine("x", words), ROOTS)
    assert len(found) == len(expected) and all(f.startswith(e) for f, e in zip(found, expected)), found


def test_the_docs_have_many_command_lines():
    """Guards the extraction: a change of the pages' format that hid the commands would leave the next test empty."""
    programs = {line.words[0] for line in LINES}
    assert len(LINES) >= 100 and {"fedroute", "fedroute-sync", "python -m trainer.cli"} <= programs
    assert any(line.words[:3] == ("fedroute", "rounds", "open") for line in LINES)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_and_options_exist(page: Path):
    wrong = [f"{line}\n    -> {p}" for line in LINES if line.where.startswith(f"{page.relative_to(ROOT)}:")
             for p in problems(line, ROOTS)]
    assert not wrong, "\n".join(wrong)


def test_the_scripts_docstring_commands_and_options_exist():
    """The ``fedroute`` lines in the module docstrings of benchmarks/ and examples/ (how to make a script's input)."""
    assert any(line.words[:2] == ("fedroute", "simulate") for line in SCRIPT_LINES)
    wrong = [f"{line}\n    -> {p}" for line in SCRIPT_LINES for p in problems(line, ROOTS)]
    assert not wrong, "\n".join(wrong)


SHARED_DATA = ROOT.parent / "shared" / "data"


def data_folder_helps() -> list[tuple[str, str]]:
    """(command, help) of every option whose help lists the shared data folder's sub-folders."""
    found = []

    def walk(command: click.Command, path: list[str]) -> None:
        if isinstance(command, click.Group):
            for name, sub in command.commands.items():
                walk(sub, [*path, name])
            return
        found.extend((" ".join([*path, p.opts[0]]), p.help) for p in command.params
                     if isinstance(p, click.Option) and "shared data folder" in (p.help or ""))

    walk(ROOTS["fedroute"], ["fedroute"])
    return found


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="no ../shared/data beside the repository")
def test_the_data_folders_an_option_help_names_exist():
    """``--help`` says which folders of ../shared/data a command reads: they exist (``mor grpo`` and ``mor
    export`` named hh_harmless/, the domain's name, for the folder hh_rlhf_harmless/)."""
    helps = data_folder_helps()
    assert {"fedroute mor train --data", "fedroute mor grpo --data", "fedroute mor export --data",
            "fedroute prism train --data"} <= {where for where, _ in helps}
    missing = [f"{where}: {name}/ ({help_})" for where, help_ in helps
               for name in re.findall(r"(?<![\w./])([a-z][a-z0-9_]*)/(?!\w)", help_) if not (SHARED_DATA / name).is_dir()]
    assert not missing, "\n".join(missing)


def test_the_readme_install_and_test_commands_are_the_ci_ones():
    """README's set-up commands and .ci/run make the same three installs in the same order (the base SDK,
    [proxy], everything; CI adds the test runner, the `test` extra, to the two light ones), with extras all
    defined in pyproject.toml and the same torch pin, and run the same test command; its -n needs
    pytest-xdist, in the dev extra."""
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    readme_code = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))

    def installs(text: str) -> list[set[str]]:
        found = re.findall(r'pip install (?:--quiet )?-e (?:"\.\[([\w,-]+)\]"|\.(?=\s|$))', text)
        return [set(filter(None, extras.split(","))) for extras in found]

    readme_installs, ci_installs = installs(readme_code), installs(ci)
    assert len(readme_installs) == 3 and set() in readme_installs and {"proxy"} in readme_installs, readme_installs
    assert ci_installs == [r if "dev" in r else r | {"test"} for r in readme_installs], (readme_installs, ci_installs)
    defined = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set().union(*ci_installs) <= set(defined)
    pin = lambda text: re.findall(r"torch==[\w.+]+", text)  # noqa: E731
    assert pin(readme) == pin(ci) and pin(ci), (pin(readme), pin(ci))
    tests_line = re.search(r"^HF_HUB_OFFLINE=1 (python -m pytest[^\n#]*?)\s*$", readme, re.M)
    assert tests_line and re.search(rf"^{re.escape(tests_line[1])}\s*$", ci, re.M), tests_line
    if " -n " in tests_line[1] + " ":
        assert any(d.startswith("pytest-xdist") for d in defined["dev"])
