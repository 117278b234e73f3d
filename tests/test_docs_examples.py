"""docs/cli.md's example sessions ("real output, trimmed") are what the CLI prints, and
format.md's recipes for reading a checkpoint without the library work as written.

Each `$ resilient-ckpt ...` line of cli.md's text blocks is run, in order, on a directory made
as the docs describe it (a run saved at steps 10 ... 60 with keep_last=3; then one bit of the
newest checkpoint's tensor data flipped; a second run pushed to a `file://` remote), and its
output compared with the block's, line for line, after times, run ids, checksums, sizes and
versions are masked and runs of spaces made one. A block with a `...` line is trimmed: its
lines must appear in the output; one without must be the whole output. `# exit N` after a
command is its exit status (0 otherwise).
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import torch

from resilient_callbacks import Checkpointer
from test_cli import cli

CLI_MD = Path(__file__).resolve().parent.parent / "docs" / "cli.md"
REMOTE_IN_DOCS = "file:///tmp/clidemo/remote"


def normalize(line: str) -> str:
    line = re.sub(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+", "<TIME>", line)
    line = re.sub(r"\b[0-9a-f]{16}\b", "<HEX>", line)
    line = re.sub(r"\b\d+(\.\d+)? (KB|MB|GB|B)\b", "<SIZE>", line)
    line = re.sub(r"\b\d+\.\d+\.\d+(\+\w+)?", "<VERSION>", line)
    return re.sub(r" +", " ", line).strip()


def sessions(text: str) -> list[tuple[str, list[str]]]:
    """(command line, output lines) of every `$ resilient-ckpt` line of the text blocks."""
    out: list[tuple[str, list[str]]] = []
    fence: str | None = None  # the language of the block the line is in; None: outside
    for line in text.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence == "" and line.startswith("$ resilient-ckpt "):
            out.append((line[2:], []))
        elif fence == "" and out and line.strip():
            out[-1][1].append(line)
    return out


def make_run(root: str) -> None:
    """cli.md's run: a Linear(16, 8) with AdamW and two extra values, saved with save() at
    steps 10 ... 60 with keep_last=3."""
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optimizer": opt, "extra": {"epoch": 0, "tokens_seen": 0}}
    with Checkpointer(root, keep_last=3, async_save=False) as ckpt:
        for step in range(1, 61):
            model(torch.randn(4, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state["extra"].update(epoch=step // 25, tokens_seen=step * 1024)
            if step % 10 == 0:
                ckpt.save(step, state, metrics={"loss": 0.0333})


def flip_tensor_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-5] ^= 1
    path.write_bytes(bytes(data))


def test_the_example_sessions_of_cli_md_print_what_the_cli_prints(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    make_run("ckpts/run1")
    make_run("run2")
    for name in ("interrupted", "uninterrupted"):
        shutil.copytree("run2", f"demo_output/plain/{name}/checkpoints")
    remote = f"file://{tmp_path}/remote"
    runs = sessions(CLI_MD.read_text())
    assert len(runs) >= 14, [c for c, _ in runs]
    flipped = False
    for command, doc_lines in runs:
        if not flipped and any("CORRUPT" in line for line in doc_lines):
            flip_tensor_bit(tmp_path / "ckpts/run1/step_000000060/shared.safetensors")
            flipped = True
        command, _, comment = command.partition("#")
        expected_rc = int(m.group(1)) if (m := re.search(r"exit (\d+)", comment)) else 0
        args = command.replace(REMOTE_IN_DOCS, remote).split()[1:]
        r = cli(*args)
        assert r.returncode == expected_rc, (command, r.stdout, r.stderr)
        real = [
            normalize(x) for x in (r.stderr + r.stdout).replace(remote, REMOTE_IN_DOCS).splitlines()
        ]
        real = [x for x in real if x]
        doc = [normalize(x) for x in doc_lines]
        trimmed = "..." in doc
        doc = [x for x in doc if x != "..."]
        missing = [x for x in doc if x not in real]
        assert not missing, f"`{command.strip()}` prints none of {missing}; it prints {real}"
        if not trimmed:
            extra = [x for x in real if x not in doc]
            assert not extra, f"`{command.strip()}` also prints {extra}, which cli.md leaves out"
    assert flipped
    assert os.path.isdir("pulled/step_000000060")


def python_blocks(text: str, after: str) -> list[str]:
    """The ```python blocks of a doc that come after the heading `after`."""
    text = text[text.index(after) :]
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def test_format_md_reads_a_checkpoint_without_the_library_as_it_says(tmp_path, monkeypatch):
    """format.md's recipes for readers of their own, run as written on an incremental
    checkpoint of step 60: the manifest's checksum of itself, and the tensors of
    shared.safetensors plus those shared.json maps to blobs, equal to the saved ones."""
    import json

    import xxhash

    text = (CLI_MD.parent / "format.md").read_text()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 2))  # one blob
    with Checkpointer(str(tmp_path), incremental=True, async_save=False) as ckpt:
        ckpt.save(60, {"model": model})
    monkeypatch.chdir(tmp_path)

    manifest = json.loads(Path("step_000000060/manifest.json").read_text())
    rule = re.search(r"written as `(json\.dumps\(rest, [^`]*\))`", text)
    assert rule, "format.md no longer says how manifest_xxh3_64 is computed"
    rest = {k: v for k, v in manifest.items() if k != "manifest_xxh3_64"}
    written = eval(rule.group(1), {"json": json, "rest": rest})
    assert xxhash.xxh3_64_hexdigest(written.encode()) == manifest["manifest_xxh3_64"]

    reading, blobs = python_blocks(text, "## Reading a checkpoint without this library")
    scope: dict = {}
    exec(reading, scope)
    exec(blobs, scope)
    want = {f"model/{k}": v for k, v in model.state_dict().items()}
    assert scope["tensors"].keys() == want.keys()
    assert all(torch.equal(scope["tensors"][k], v) for k, v in want.items())
    assert scope["refs"] == {"model/0.weight": scope["refs"]["model/0.weight"]}
