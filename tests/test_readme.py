"""Every command in the README is copy-pasteable: the flags of each ``train_genrl.py`` and
``eval_genrl.py`` command parse with the scripts' own parsers (for as many processes, and under
the ZeRO stage, as its launch line asks), every launch line names a shipped accelerate config and
its process count, and the commands that are cheap on a CPU run for real. The quickstart itself
(about 5 minutes) is what ``.ci/run`` runs; the README must keep it and the test command CI calls.

Commands are read from the README's ```bash blocks as a shell reads them: lines joined at a
trailing backslash or an open quote, ``#`` comments dropped, ``&&``/``;``/``|`` separating
commands, ``bash -c '...'`` opened, and ``cat > FILE <<'EOF'`` writing FILE (here into a
temporary folder put on the import path). ``/models/...`` stands for the user's local copies of
reward weights; the parse checks that local paths exist, so the test creates them under a
temporary folder.
"""

import json
import os
import re
import shlex
import sys

import pytest
import yaml

from conftest import ROOT, run_python, script_env

README = os.path.join(ROOT, "README.md")
SCRIPTS = ("train_genrl.py", "eval_genrl.py")
OPERATORS = {"&&", "||", ";", "|"}
PLACEHOLDER = "/models/"


def bash_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, body) of each ```bash block."""
    return [(text[: m.start(1)].count("\n") + 1, m.group(1)) for m in re.finditer(r"```bash\n(.*?)```", text, re.S)]


def logical_lines(body: str, first_line: int):
    """(line number, text, {file: content}) of each shell command line: continuation lines
    joined, heredocs taken out as the files they write."""
    lines = body.split("\n")
    i = 0
    while i < len(lines):
        number, text, files = first_line + i, lines[i], {}
        heredoc = re.search(r"<<-?\s*'?(\w+)'?", text)
        if heredoc:
            target = re.search(r">\s*(\S+)", text).group(1)
            end = lines.index(heredoc.group(1), i + 1)
            files[target] = "\n".join(lines[i + 1 : end]) + "\n"
            i = end + 1
            yield number, "", files
            continue
        while True:  # join a trailing backslash or an unclosed quote with the next line
            if text.endswith("\\"):
                text = text[:-1] + " " + lines[i + 1]
                i += 1
                continue
            try:
                shlex.split(text, comments=True)
            except ValueError:  # no closing quotation
                text = text + "\n" + lines[i + 1]
                i += 1
                continue
            break
        i += 1
        yield number, text, files


def split_words(text: str) -> list[str]:
    """The shell words of a line, with ``bash -c '...'`` strings opened into their own words."""
    words = []
    for word in shlex.split(text, comments=True):
        if any(s in word for s in SCRIPTS) and " " in word:
            words.extend(split_words(word))
        else:
            words.append(word)
    return words


def segments(words: list[str]) -> list[list[str]]:
    out, current = [], []
    for word in words:
        if word in OPERATORS:
            out.append(current)
            current = []
        else:
            current.append(word)
    return out + [current]


class Command:
    def __init__(self, line: int, words: list[str], files: dict):
        index = next(i for i, w in enumerate(words) if w.endswith(SCRIPTS))
        self.line, self.launcher, self.script, self.args, self.files = line, words[:index], os.path.basename(words[index]), words[index + 1 :], files
        self.accelerate = "accelerate" in self.launcher
        self.config_file = self.value(self.launcher, "--config_file")
        config = {}
        if self.config_file and os.path.isfile(os.path.join(ROOT, self.config_file)):
            with open(os.path.join(ROOT, self.config_file)) as f:
                config = yaml.safe_load(f)
        self.config = config
        explicit = self.value(self.launcher, "--num_processes")
        self.num_processes = int(explicit) if explicit else int(config.get("num_processes", 1))
        self.explicit_processes = explicit is not None
        self.zero_stage = (config.get("deepspeed_config") or {}).get("zero_stage") if config.get("distributed_type") == "DEEPSPEED" else None

    @staticmethod
    def value(words: list[str], flag: str):
        return words[words.index(flag) + 1] if flag in words else None

    @property
    def recipe(self):
        return self.value(self.args, "--config")

    def __repr__(self):
        return f"README:{self.line}:{self.script}"


def readme_commands() -> list[Command]:
    text = open(README, encoding="utf-8").read()
    commands, pending_files = [], {}
    for first, body in bash_blocks(text):
        pending_files = {}
        for number, line, files in logical_lines(body, first):
            pending_files.update(files)
            if not line.strip():
                continue
            for words in segments(split_words(line)):
                if any(w.endswith(SCRIPTS) for w in words):
                    commands.append(Command(number, words, dict(pending_files)))
    return commands


COMMANDS = readme_commands()


def param(command: Command):
    return pytest.param(command, id=repr(command))


def with_local_copies(args: list[str], root) -> list[str]:
    """The README's /models/... placeholders made real under ``root``: a file where the name has
    a weights suffix, else a folder."""
    out = []
    for arg in args:
        if PLACEHOLDER in arg:
            for path in set(re.findall(r"/models/[\w./-]+", arg)):
                local = os.path.join(str(root), path.lstrip("/"))
                if local.endswith((".safetensors", ".bin", ".pth", ".pt")):
                    os.makedirs(os.path.dirname(local), exist_ok=True)
                    open(local, "w").close()
                else:
                    os.makedirs(local, exist_ok=True)
            arg = arg.replace(PLACEHOLDER, os.path.join(str(root), "models") + "/")
        out.append(arg)
    return out


def write_files(files: dict, folder) -> None:
    for name, content in files.items():
        with open(os.path.join(str(folder), name), "w") as f:
            f.write(content)


def test_the_readme_keeps_the_commands_ci_runs():
    text = open(README, encoding="utf-8").read()
    blocks = "\n".join(body for _, body in bash_blocks(text))
    assert "pip install -r requirements.txt && accelerate launch train_genrl.py" in blocks
    assert re.search(r"^## Tests\n(.|\n)*?```bash\npython -m pytest -q\npython -m pytest -q -m extended\n```", text, re.M), \
        "the Tests section's commands"
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert "python3 -m pytest -q" in ci and "python3 -m pytest -q -m extended" in ci, "CI runs both lanes as written"
    scripts = {c.script for c in COMMANDS}
    assert scripts == set(SCRIPTS) and len(COMMANDS) >= 10


def known_flags(script: str) -> set[str]:
    """The option strings of a script's parser (eval_genrl.py builds its parser inside parse_args:
    its --help lists them)."""
    if script == "train_genrl.py":
        from genrl.training.train_args import build_parser

        return {s for action in build_parser()._actions for s in action.option_strings} | {"--config"}
    import contextlib
    import io

    import eval_genrl

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        eval_genrl.parse_args(["--help"])
    return set(re.findall(r"(--[a-z_][\w-]*)", out.getvalue()))


@pytest.mark.parametrize("command", COMMANDS, ids=repr)
def test_every_flag_is_one_the_script_knows(command):
    # Checked on every command, those with a --config file that is not there yet included.
    known = known_flags(command.script)
    unknown = [w for w in command.args if w.startswith("--") and w.split("=")[0] not in known]
    assert not unknown, f"{command}: unknown flags {unknown}"


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.accelerate], ids=repr)
def test_every_launch_line_names_a_shipped_config_and_its_process_count(command):
    if command.config_file is None:
        return  # accelerate's own default: one process per GPU, or one on a CPU
    assert os.path.isfile(os.path.join(ROOT, command.config_file)), f"{command}: no {command.config_file}"
    if command.config.get("distributed_type") != "NO" and command.config.get("num_machines", 1) == 1:
        # The shipped multi-process configs name 1 or 2 processes: a launch line must say how many.
        assert command.explicit_processes, (f"{command}: {command.config_file} says num_processes "
                                            f"{command.config.get('num_processes')}; pass --num_processes")


@pytest.mark.parametrize("command", [param(c) for c in COMMANDS])
def test_every_command_parses(command, tmp_path, monkeypatch, capsys):
    # The flags parse as the script parses them, for the processes and ZeRO stage the launch asks for.
    args = with_local_copies(command.args, tmp_path)
    write_files(command.files, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(ROOT)
    for name in ("WORLD_SIZE", "MASTER_ADDR", "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_DEEPSPEED_ZERO_STAGE"):
        monkeypatch.delenv(name, raising=False)
    if command.num_processes > 1:
        monkeypatch.setenv("WORLD_SIZE", str(command.num_processes))
    if command.zero_stage is not None:
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", str(command.zero_stage))
    if "--help" in args:
        return  # runs for real below
    try:
        if command.script == "train_genrl.py":
            from genrl.training.train_args import parse_args

            parse_args(args)
        else:
            import eval_genrl

            eval_genrl.parse_args(args)
    except SystemExit as exit_:
        pytest.fail(f"{command}: {' '.join(args)}\nexit {exit_.code}: {capsys.readouterr().err.strip()}")


def cheap(command: Command) -> bool:
    """Runs in seconds to a minute on a CPU: help, a toy run of at most 2 steps, the toy model's evaluation."""
    if command.accelerate or command.recipe:
        return False
    if "--help" in command.args:
        return True
    if command.script == "train_genrl.py":
        steps = command.value(command.args, "--max_train_steps")
        return "--pretrained_model_name_or_path" not in command.args and steps is not None and int(steps) <= 2
    return command.value(command.args, "--model") == "genrl/assets/toy-shapes-t2i" and "--compare" not in command.args


CHEAP = [c for c in COMMANDS if cheap(c)]


def test_there_are_cheap_commands_to_run():
    assert {c.script for c in CHEAP} == set(SCRIPTS) and any("--help" not in c.args for c in CHEAP)


@pytest.mark.slow
@pytest.mark.parametrize("command", [param(c) for c in CHEAP])
def test_cheap_commands_run(command, tmp_path):
    args = list(command.args)
    if "--output_dir" in args:  # the run's outputs go to a temporary folder, not the checkout
        args[args.index("--output_dir") + 1] = str(tmp_path / "out")
    write_files(command.files, tmp_path)
    env = script_env()
    if command.files:
        env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    proc = run_python(command.script, args, cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, f"{command}: {' '.join(args)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    if "--help" in args:
        assert "usage:" in proc.stdout
    elif command.script == "train_genrl.py":
        assert os.path.isfile(tmp_path / "out" / "README.md") and os.path.isfile(tmp_path / "out" / "genrl_config.json")
    else:
        assert json.load(open(tmp_path / "out" / "metrics.json"))


def test_paths_named_in_the_docs_exist():
    """Every ``genrl/...`` path the README, bench/README.md and docs/ name exists: a module moved
    or renamed without its docs leaves newcomers looking in the wrong place."""
    docs = [README, os.path.join(ROOT, "bench", "README.md")]
    docs += [os.path.join(ROOT, "docs", name) for name in os.listdir(os.path.join(ROOT, "docs")) if name.endswith(".md")]
    missing = []
    for doc in docs:
        with open(doc) as f:
            text = f.read()
        for path in set(re.findall(r"\bgenrl/[A-Za-z0-9_./-]*[A-Za-z0-9_/]", text)):
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{os.path.relpath(doc, ROOT)}: {path}")
    assert not missing, missing
