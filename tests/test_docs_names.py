"""What the docs tell users to import exists where they are told to import it."""

from __future__ import annotations

import re
from pathlib import Path

import resilient_callbacks

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_error_in_the_guide_table_is_importable_from_the_package():
    """docs/guide.md's table of errors and warnings (found 2026-11-25: RemoteUnavailableError
    was listed there, and caught in remote.md's examples, but not importable from the
    package)."""
    text = (DOCS / "guide.md").read_text()
    names = set(re.findall(r"^\| `(\w+(?:Error|Warning))` \|", text, re.MULTILINE))
    assert len(names) >= 9, names
    missing = sorted(n for n in names if not hasattr(resilient_callbacks, n))
    assert not missing, f"documented but not importable from resilient_callbacks: {missing}"
    assert not sorted(n for n in names if n not in resilient_callbacks.__all__)
    # and every error the package exports is in it (UnknownOptionError was not)
    exported = {n for n in resilient_callbacks.__all__ if n.endswith("Error")}
    missing = sorted(exported - names - {"CheckpointError"})
    assert not missing, f"exported but not in guide.md's table of errors: {missing}"
    for name in names:  # its "also a" column: the classes it derives from
        row = re.search(rf"^\| `{name}` \| ([^|]*) \|", text, re.M)
        bases = set(re.findall(r"`(\w+)`", row.group(1)))
        cls = getattr(resilient_callbacks, name)
        real = {c.__name__ for c in cls.__mro__[1:]}
        assert bases <= real, f"{name} is not a {sorted(bases - real)}"


ROOT = DOCS.parent
# Where a docs table's default is a word, the values it stands for.
DEFAULT_WORDS = {
    "off": (None, False),
    "none": (None,),
    "detected": (None,),
    "every save": (None,),
}


def _option_rows(text: str) -> list[tuple[list[str], str]]:
    """(names, default cell) of each row of the `| option | default | meaning |` tables."""
    rows = []
    for table in re.findall(r"^\| option \| default \|.*\n\|[-| ]+\|\n((?:\|.*\n)+)", text, re.M):
        for line in table.splitlines():
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((re.findall(r"`(\w+)`", cells[0]), cells[1]))
    return rows


def _documented_defaults(names: list[str], cell: str) -> dict[str, tuple[object, ...]]:
    """What the default cell says of each name, where it is plain: one backticked literal
    per name (`"none"`, `1`, `True`), a word of DEFAULT_WORDS for all, or both
    (`off, "loss"`); "as `x`" (another option's value) means None. A parenthesis names
    exceptions: `off (`remote_timeout` `30`)`, `on (...; `handle_sigint` off)`."""
    import ast

    def value(part: str) -> tuple[object, ...] | None:
        if part in DEFAULT_WORDS:
            return DEFAULT_WORDS[part]
        if part.startswith("`") and part.endswith("`"):
            return (ast.literal_eval(part.strip("`")),)
        return None

    if cell.startswith("as `"):
        return {n: (None,) for n in names}
    head, _, paren = cell.partition(" (")
    parts = [p.strip() for p in head.split(",")]
    if len(parts) == 1 and parts[0] in DEFAULT_WORDS:
        parts = parts * len(names)
    out: dict[str, tuple[object, ...]] = {}
    if len(parts) == len(names):  # else prose: only the exceptions are checked
        for name, part in zip(names, parts, strict=True):
            if (v := value(part)) is not None:
                out[name] = v
    for name, part in re.findall(r"`(\w+)` (`[^`]*`|[a-z ]+?)(?=[,;)])", paren):
        if name in names and (v := value(part)) is not None:
            out[name] = v
    return out


def _same_default(real: object, documented: object) -> bool:
    """`30` documents 30.0; `0` does not document False, nor `None` 0."""
    if isinstance(real, float) and type(documented) is int:
        return real == documented
    return type(real) is type(documented) and real == documented


def test_the_option_tables_name_checkpointer_options_with_their_real_defaults():
    """Every `| option | default |` table of the docs (guide.md's, remote.md's,
    incremental.md's) names parameters of Checkpointer, gives the default the signature has,
    and guide.md's table lists every parameter: an option added, renamed or given another
    default without the docs fails here."""
    import inspect

    params = inspect.signature(resilient_callbacks.Checkpointer.__init__).parameters
    checked = 0
    for path in sorted(DOCS.glob("*.md")):
        for names, cell in _option_rows(path.read_text()):
            unknown = [n for n in names if n not in params]
            assert not unknown, f"{path.name}: {unknown} in its option table are not options"
            for name, allowed in _documented_defaults(names, cell).items():
                real = params[name].default
                assert any(_same_default(real, a) for a in allowed), (
                    f"{path.name}: {name} default {cell!r}, Checkpointer's is {real!r}"
                )
                checked += 1
    assert checked >= 40, checked
    guide = {n for names, _ in _option_rows((DOCS / "guide.md").read_text()) for n in names}
    missing = sorted(set(params) - {"self", "dirpath"} - guide)
    assert not missing, f"Checkpointer options missing from guide.md's options table: {missing}"


def _github_anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_github_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_links_between_the_docs_resolve():
    """Every relative link of README.md, docs/*.md and the integrations' READMEs names a file
    that exists and, with #anchor, a heading of it (GitHub's anchors: lower case, punctuation
    dropped)."""
    bad = []
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    for path in [*pages, *sorted((ROOT / "integrations").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"\w+://|mailto:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file) if file else path
            if not dest.exists():
                bad.append(f"{path.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                bad.append(f"{path.relative_to(ROOT)}: {target} (no such heading)")
    assert not bad, bad


def test_the_tests_the_docs_cite_exist():
    """`tests/x.py::test_name` and `tests/x.py` that the docs give as proof exist, so a
    renamed or deleted test does not leave a claim citing nothing."""
    bad = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for file, name in re.findall(r"`(tests/[\w/]+\.py)(?:::(\w+))?", path.read_text()):
            if not (ROOT / file).is_file():
                bad.append(f"{path.name}: {file}")
            elif name and not re.search(rf"def {name}\b", (ROOT / file).read_text()):
                bad.append(f"{path.name}: {file}::{name}")
    assert not bad, bad


def _cli_table(text: str) -> dict[str, set[str]]:
    """The options each command's rows of cli.md's command table name."""
    out: dict[str, set[str]] = {}
    for usage in re.findall(
        r"^\| `((?:ls|verify|inspect|gc|pull|push|export|report) [^`]*)` \|", text, re.M
    ):
        out.setdefault(usage.split()[0], set()).update(
            re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", usage)
        )
    return out


def test_the_cli_table_gives_each_command_the_options_it_has():
    """cli.md's table of commands lists every option of each command's parser and no other
    (-h aside), and --version prints what cli.md says."""
    from resilient_callbacks.cli_parser import build_parser, package_version

    text = (DOCS / "cli.md").read_text()
    documented = _cli_table(text)
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    assert set(documented) == set(sub.choices), sorted(documented)
    for cmd, p in sub.choices.items():
        real = {s for a in p._actions for s in a.option_strings if s not in ("-h", "--help")}
        # a long and a short spelling of one option: either may be documented
        spelled = {
            a.option_strings[0]: set(a.option_strings) for a in p._actions if a.option_strings
        }
        missing = [
            o for o, names in spelled.items() if o not in ("-h",) and not names & documented[cmd]
        ]
        assert not missing, f"cli.md's table lacks {cmd} {missing}"
        assert documented[cmd] <= real, f"cli.md's table gives {cmd} {documented[cmd] - real}"
    assert f"prints `resilient-ckpt {package_version()}`" in text


def _init_signature(source: Path, cls: str) -> str:
    """`cls(...)` as the docs write it, read from the source (importing the adapter would
    import its framework): `name=default` for each parameter, `*`, `**kwargs`."""
    import ast

    tree = ast.parse(source.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    a = init.args
    positional = a.args[1:]
    defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    parts = [
        p.arg if d is None else f"{p.arg}={ast.unparse(d)}"
        for p, d in zip(positional, defaults, strict=True)
    ]
    if a.kwonlyargs:
        parts.append("*")
        parts += [
            p.arg if d is None else f"{p.arg}={ast.unparse(d)}"
            for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
        ]
    if a.kwarg:
        parts.append(f"**{a.kwarg.arg}")
    return f"{cls}({', '.join(parts)})"


def test_the_lightning_callbacks_signature_in_the_docs_is_its_own():
    """lightning.md's "Options" gives the callback's signature in full."""
    text = " ".join((DOCS / "lightning.md").read_text().split())
    real = _init_signature(
        ROOT / "src" / "resilient_callbacks" / "lightning" / "callback.py", "ResilientCheckpoint"
    )
    assert f"`{real}`" in text, real


def test_the_transformers_callbacks_signature_in_the_docs_is_its_own():
    """transformers.md gives the callback's signature in full, as lightning.md does (found
    2026-12-06: `save_on_evaluate` and `save_on_train_end` were named, their defaults not)."""
    text = " ".join((DOCS / "transformers.md").read_text().split())
    real = _init_signature(
        ROOT / "src" / "resilient_callbacks" / "transformers" / "callback.py", "ResilientCheckpoint"
    )
    assert f"`{real}`" in text, real


def _module_file(module: str) -> Path | None:
    path = ROOT / "src" / Path(*module.split("."))
    if (path / "__init__.py").exists():
        return path / "__init__.py"
    return path.with_suffix(".py") if path.with_suffix(".py").exists() else None


def _defines(source: Path, name: str) -> bool:
    """The module defines or imports `name`, or names it in a lazy-import table (read from
    the source: importing the adapters would import their frameworks)."""
    import ast

    defined: set[str] = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            defined.update(a.asname or a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            defined.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return name in defined or f'"{name}"' in source.read_text()


def test_what_the_docs_import_from_the_package_exists():
    """`from resilient_callbacks.x import Y` in the docs' examples, and every dotted
    `resilient_callbacks.x.Y` they name, resolve to a module of src/ that defines Y."""
    bad = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = path.read_text()
        for module, names in re.findall(
            r"from (resilient_callbacks[.\w]*) import ([\w, ()]+)", text
        ):
            source = _module_file(module)
            for name in re.findall(r"\w+", names):
                if source is None or not (
                    _module_file(f"{module}.{name}") or _defines(source, name)
                ):
                    bad.append(f"{path.name}: from {module} import {name}")
        for dotted in set(re.findall(r"`(resilient_callbacks(?:\.\w+)+)", text)):
            parts = dotted.split(".")
            k = max(k for k in range(1, len(parts) + 1) if _module_file(".".join(parts[:k])))
            source = _module_file(".".join(parts[:k]))
            if source and k < len(parts) and not _defines(source, parts[k]):
                bad.append(f"{path.name}: {dotted}")
    assert not bad, bad


def test_the_docs_training_loops_save_their_last_step():
    """A ```python block of the docs that runs a training loop through the library (a
    `ckpt.step(...)` or a DeepSpeed `engine.step()` inside `while`/`for`) also saves the end
    (`final=`), so a user who copies it gets what the docs promise: a finished run re-run
    trains nothing (found 2026-12-06: deepspeed.md's `rcds.initialize` loop and fsdp.md's
    `Sharded` loop ended on the schedule's last save, and a re-run trained the rest again)."""
    loops = 0
    bad = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for block in re.findall(r"^```python\n(.*?)^```", path.read_text(), re.M | re.S):
            if not re.search(r"^\s*(while|for) ", block, re.M):
                continue
            if not re.search(r"\bckpt\.step\(|\bengine\.step\(\)", block):
                continue
            loops += 1
            if "final=" not in block:
                bad.append(f"{path.name}: {block.splitlines()[0]}")
    assert loops >= 4, loops
    assert not bad, f"training loops that never save their last step: {bad}"


def test_policy_md_names_every_option_of_the_metadata_poller():
    """`metadata_notices={...}`'s keys go to MetadataPoller: policy.md names each (found
    2026-12-06: `warn_after_failures`, `aws_imdsv2` and `azure_event_types` were behind a
    "...")."""
    import inspect

    from resilient_callbacks import MetadataPoller

    text = (DOCS / "policy.md").read_text()
    params = inspect.signature(MetadataPoller.__init__).parameters
    missing = [n for n in params if n not in ("self", "watcher", "kind") and f"`{n}`" not in text]
    assert not missing, f"MetadataPoller options policy.md does not name: {missing}"


def test_the_benchmark_commands_of_the_docs_name_scripts_and_options_that_exist():
    """`benchmarks/x.py --opt ...` that the docs give as the source of a figure names a script
    that exists and options its parser takes (its own, or `common.py`'s that it imports), so
    a renamed script or option does not leave a figure whose command fails at once."""
    common = (ROOT / "benchmarks" / "common.py").read_text()
    bad = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for script, rest in re.findall(r"(benchmarks/\w+\.py)([^`\n#]*)", path.read_text()):
            source = ROOT / script
            if not source.is_file():
                bad.append(f"{path.name}: {script} (no such file)")
                continue
            text = source.read_text()
            if "from common import" in text:
                text += common
            for opt in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                if f'"{opt}"' not in text:
                    bad.append(f"{path.name}: {script} {opt}")
    assert not bad, bad


def test_the_modules_architecture_md_names_exist():
    """Every `name.py` (or `dir/name.py`) that architecture.md describes is a module of the
    package, so a module renamed, merged or split does not leave the map naming nothing."""
    src = ROOT / "src" / "resilient_callbacks"
    modules = {p.relative_to(src).as_posix() for p in src.rglob("*.py")}
    named = set(re.findall(r"`([\w/]+\.py)`", (DOCS / "architecture.md").read_text()))
    named = {n for n in named if not n.startswith("tests/")}  # (the test above checks those)
    bad = sorted(n for n in named if not any(m == n or m.endswith("/" + n) for m in modules))
    assert not bad, bad
