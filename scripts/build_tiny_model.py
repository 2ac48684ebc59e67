"""Build tbexp's tiny model from scratch: tokenizer, Llama weights, shell pretraining.

    python scripts/build_tiny_model.py              # writes tbexp/models/tiny/ (about a minute or two on 2 cores)
    python scripts/build_tiny_model.py --check      # then measures what SFT on the built-in tasks buys
    python scripts/build_tiny_model.py --protocol terminus_2 --vocab 2000 --steps 1000   # tiny_terminus/ (23 min)

Deterministic from `--seed` on one machine (same CPU kind, same torch). Four steps:

1. A synthetic corpus of short raw_command episodes (`episodes` below): an
   instruction in the raw_command prompt, one bash command per assistant
   turn, made-up command output plus `[exit N]` as the next user turn, and
   `exit` at the end. With `--protocol terminus_2` the same chores as
   Harbor's terminus-2 shows them (`_TerminusWriter`), every other one: its
   2,900-character prompt with the instruction near the end, JSON replies,
   a 40-row pane as the observation, the double `task_complete`. The
   raw_command model never saw a prompt that long, and after SFT it does
   not tell the tasks apart from it (docs/terminus-2.md).
   Generic chores over generic names (half of them made-up words, so that
   copying a name of several tokens from the instruction is practised;
   before SFT neither model copies one reliably); none of the built-in task families' name pools,
   instructions or command templates, so the model knows the protocol and
   shell syntax but not the tasks.
2. A byte-level BPE tokenizer (digits split one by one) trained on that
   corpus, plus the chat tokens `<|pad|> <|user|> <|assistant|> <|end|>`.
3. A LlamaForCausalLM with tied embeddings, pretrained on the corpus as the
   `plain` renderer writes it, loss on every token (the model also learns
   what instructions and outputs look like) but Harbor's fixed prompt text, AdamW with warm-up and cosine
   decay; batches group episodes of similar length to pad less.
4. `save_pretrained` (safetensors), the tokenizer files, a README.

`--check` writes the built-in suite, greedy-decodes the first command of
every held-out task, fine-tunes a copy on the train tasks' first oracle
command (completion-only loss; full fine-tuning, or LoRA with
`--check-lora-rank`) and decodes again. Exact match of the first command
before and after says whether tokenizer and model size are right: the
model must not know the tasks before, and must learn them from ~400 rows.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tbexp.models import SHIPPED, SHIPPED_DIR  # noqa: E402
from tbexp.models.renderers import make_renderer  # noqa: E402

SPECIALS = ["<|pad|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (  # the `plain` renderer's format, for tools that use apply_chat_template
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}<|end|>"
    "{% else %}<|assistant|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
BUILD_COMMAND = "python scripts/build_tiny_model.py"
TERMINUS_INSTRUCTION_MARK = "Task Description:\n"  # in Harbor's template, just before the instruction
PROTOCOL_DIRS = {protocol: name for name, protocol in SHIPPED.items()}  # the agent the corpus speaks -> tbexp/models/


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", choices=PROTOCOL_DIRS, default="raw_command", help="the agent the corpus speaks")
    parser.add_argument("--out", type=Path, help="default: tbexp/models/tiny (raw_command), tiny_terminus (terminus_2)")
    parser.add_argument("--steps", type=int, default=600, help="pretraining steps of --batch episodes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--ffn", type=int, default=384)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--check", action="store_true", help="measure held-out first-command exact match before and after SFT"
    )
    parser.add_argument(
        "--check-only", action="store_true", help="no build: --check on the model in --out, in --protocol's format"
    )
    parser.add_argument("--check-steps", type=int, default=300)
    parser.add_argument("--check-lr", type=float, default=2e-3)
    parser.add_argument("--check-lora-rank", type=int, default=0, help="0 = full fine-tuning")
    args = parser.parse_args()
    args.out = args.out or SHIPPED_DIR / PROTOCOL_DIRS[args.protocol]
    torch.set_num_threads(args.threads)
    # --check-only, e.g. the raw_command model on terminus-2's prompt: `--protocol terminus_2 --out tbexp/models/tiny`
    if args.check_only:
        print(json.dumps(check(args), indent=1))
        return
    started = time.time()

    corpus = episodes(random.Random(args.seed), args.steps * args.batch, args.protocol)
    tokenizer = _train_tokenizer(corpus, args.vocab)
    renderer = make_renderer("plain", tokenizer)
    data = [renderer.supervised(messages)[0] for messages in corpus]
    weights = [_weights(tokenizer, messages, tokens) for messages, tokens in zip(corpus, data)]
    print(
        f"corpus: {len(corpus)} episodes, {sum(map(len, data))} tokens ({sum(map(len, data)) / len(data):.0f} per episode)"
    )

    torch.manual_seed(args.seed)
    model = _build_model(args, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters")
    losses = _train(model, list(zip(data, weights)), tokenizer.pad_token_id, args, args.steps, args.lr, bucket=True)
    build_s = time.time() - started

    record = {
        "protocol": args.protocol,
        "vocab": args.vocab,
        "seed": args.seed,
        "steps": args.steps,
        "params": n_params,
        "loss_first": round(_mean(losses[:25]), 3),
        "loss_last": round(_mean(losses[-25:]), 3),
        "build_s": round(build_s, 1),
        "threads": args.threads,
        "batch": args.batch,
        "check_steps": args.check_steps,
    }
    _save(model.to("cpu"), tokenizer, args.out)
    print(f"saved {args.out} in {build_s:.0f} s")
    if args.check:
        record["check"] = check(args)
    _describe(args.out, model.config, len(tokenizer), record)
    print(f"{args.out}: {_size_mb(args.out):.1f} MB")


# --- the pretraining corpus -------------------------------------------------------------------
# Generic chores in the raw_command protocol. Every name below is filtered against the built-in
# families' pools (`_builtin_names`), and no template is a family's instruction or oracle command
# (no `grep -c ' LEVEL svc:'`, `jq '[.[].f] | add'`, awk sums, `rev | tr ACGT`, `mkdir && mv *.ext`,
# `git -c user.name`, `SELECT name ... > N ORDER BY name`, `grep -rl`, `tar -tf`/`-xOf`).

ROOTS = ("/app", "/app", "/app", "/app", "/srv", "/home/user", "/workspace", "/root", "/opt/service")
DIRS = (
    "src lib bin build dist assets static media conf etc tmp scripts vendor pkg web api images music videos photos "
    "projects work repo www public private home spec fixtures templates layouts styles fonts icons migrations "
    "models views routes handlers jobs queue reports input output results stats config cache tests logs"
).split()
STEMS = (
    "main app server client index utils helpers settings changelog users accounts customers employees students books "
    "movies songs cities countries colors animals fruits planets hosts ports routes words numbers values prices scores "
    "grades temps readings sensors people contacts tasks builds deps packages modules paths urls links emails phones "
    "stations trains flights hotels recipes ingredients events orders guests players teams"
).split()
TEXT_EXTS = ("txt", "txt", "txt", "csv", "tsv", "log", "md", "conf", "ini", "yaml", "xml", "html")
CODE_EXTS = ("py", "sh", "conf", "ini", "yaml", "xml", "html", "c", "h", "go", "js", "toml", "cfg", "bak", "tmp")
WORDS = (
    "warning failed timeout hello world admin root guest debug token session secret user localhost port version "
    "license copyright import return main fixme panic denied refused missing unknown deprecated foo bar baz http "
    "https ssh cron python java node docker nginx redis kafka"
).split()
KEYS = "id name title author year email status tags version host port user enabled role owner created url path lang label kind".split()
VALUES = "active inactive admin guest open closed draft en de yes no linux".split()
TABLES = (
    "users accounts employees students books movies songs events sessions planets tickets tasks jobs players".split()
)
COLUMNS = (
    "id name email title year rank status salary grade pages length duration votes population distance speed".split()
)
BRANCHES = "feature dev fix-login hotfix release staging experiment cleanup refactor next".split()
MESSAGES = (
    "Fix typo",
    "Update docs",
    "Add tests",
    "Refactor parser",
    "Bump version",
    "Remove dead code",
    "Fix login bug",
    "Add logging",
    "Update dependencies",
    "Clean up",
)
PHRASES = (
    "hello world",
    "all good",
    "build passed",
    "it works",
    "copy complete",
    "ready",
    "ok",
    "no problems seen",
    "version 2",
)
PROGRAMS = "python3 bash git curl tar gzip make gcc node sqlite3 jq awk sed perl".split()
PROCESSES = "nginx python3 sshd cron postgres redis-server node".split()
VARIABLES = "HOME PATH USER SHELL LANG PWD TERM EDITOR".split()
ORDINALS = ("first", "second", "third", "fourth", "fifth")
SEPARATORS = (",", ":", ";", "|")
NUMBERS = (2, 4, 5, 6, 8, 10, 12, 15, 20)
SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou") + ("an", "el", "or", "ix", "um")
PSEUDO_WORDS = 0.5  # share of names that are made up


def _builtin_names() -> set[str]:
    """Every entry of the built-in families' name pools, lower-cased, with and without its extension."""
    import importlib
    import pkgutil

    import tbexp.tasks.builtin as builtin

    found: set[str] = set()

    def walk(value) -> None:
        if isinstance(value, str):
            found.update({value.lower(), value.lower().split(".")[0]})
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(key)
                walk(item)
        elif isinstance(value, (tuple, list)):
            for item in value:
                walk(item)

    for info in pkgutil.iter_modules(builtin.__path__):
        module = importlib.import_module(f"{builtin.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.isupper() and isinstance(value, (tuple, dict)):
                walk(value)
    return found


class _Names:
    """Draws the generic names of one episode; `v` maps each <placeholder> to its text."""

    def __init__(self, rng: random.Random, pools: dict[str, list[str]], banned: set[str]):
        self.rng, self.pools, self.banned = rng, pools, banned
        dirs, stems = [self.name("dirs") for _ in range(3)], [self.name("stems") for _ in range(4)]
        root = rng.choice(ROOTS)
        d, d2 = f"{root}/{dirs[0]}", f"{root}/{dirs[1]}"
        ext, code_ext = rng.choice(TEXT_EXTS), rng.choice(CODE_EXTS)
        words, keys, columns = (
            [self.name("words") for _ in range(3)],
            [self.name("keys") for _ in range(2)],
            [self.name("columns") for _ in range(2)],
        )
        k = rng.randint(1, 5)
        a, b = sorted(rng.sample(range(1, 30), 2))
        self.files = [f"{stems[i]}.{rng.choice(TEXT_EXTS)}" for i in range(4)]
        self.files[0] = f"{stems[0]}.{ext}"
        self.v = {
            "root": root,
            "d": d,
            "d2": d2,
            "dname": dirs[0],
            "sub": f"{d}/{dirs[2]}",
            "name": self.files[0],
            "f": f"{d}/{self.files[0]}",
            "f2": f"{d}/{self.files[1]}",
            "g": f"{d2}/{self.files[2]}",
            "o": f"{root}/{stems[3]}.txt",
            "e": ext,
            "ce": code_ext,
            "json": f"{d}/{stems[1]}.json",
            "db": f"{root}/{stems[2]}.{rng.choice(('db', 'sqlite'))}",
            "tgz": f"{root}/{dirs[0]}.tar.gz",
            "script": f"{root}/{rng.choice(('run', 'deploy', 'install', 'start', 'check'))}.sh",
            "w": words[0],
            "w2": words[1],
            "a": words[1],
            "b": words[2],
            "key": keys[0],
            "key2": keys[1],
            "val": rng.choice(pools["values"]),
            "t": rng.choice(pools["tables"]),
            "c": columns[0],
            "c2": columns[1],
            "br": rng.choice(BRANCHES),
            "msg": rng.choice(MESSAGES),
            "phrase": rng.choice(PHRASES),
            "prog": rng.choice(PROGRAMS),
            "proc": rng.choice(PROCESSES),
            "var": rng.choice(VARIABLES),
            "k": str(k),
            "ord": ORDINALS[k - 1],
            "n": str(rng.choice(NUMBERS)),
            "lo": str(a),
            "hi": str(b),
            "x": str(rng.randint(2, 99)),
            "y": str(rng.randint(2, 99)),
            "sep": rng.choice(SEPARATORS),
        }

    def name(self, pool: str) -> str:
        """A name from the pool, or half the time a made-up word, so that copying names of several tokens is learnt."""
        if self.rng.random() < PSEUDO_WORDS:
            while True:
                word = "".join(self.rng.choice(SYLLABLES) for _ in range(self.rng.randint(2, 3)))
                if word not in self.banned:
                    return word
        return self.rng.choice(self.pools[pool])

    def fill(self, text: str) -> str:
        return re.sub(r"<(\w+)>", lambda m: self.v[m.group(1)], text)

    # Fake outputs: plausible, short, never executed.
    def lines(self, count: int | None = None) -> str:
        rng = self.rng
        vocabulary = self.pools["words"] + self.pools["keys"] + self.pools["values"]
        return "\n".join(
            " ".join(rng.choices(vocabulary, k=rng.randint(2, 6))) for _ in range(count or rng.randint(1, 5))
        )

    def listing(self) -> str:
        names = sorted(
            set(self.files + [f"{s}.{self.rng.choice(TEXT_EXTS)}" for s in self.rng.sample(self.pools["stems"], 3)])
        )
        return "\n".join(names)

    def number(self) -> str:
        return str(self.rng.randint(0, 400))


# (instruction variants separated by " | ", command, output kind). Output kinds: "" (nothing),
# "lines", "listing", "number", "count" (`N <f>`), or a literal with <placeholders>.
TEMPLATES: tuple[tuple[str, str, str], ...] = (
    ("List the files in <d>. | Show what is in the directory <d>. | What files does <d> contain?", "ls <d>", "listing"),
    ("List everything in <d>, hidden files included.", "ls -a <d>", "listing"),
    ("Show a long listing of <d>.", "ls -l <d>", "listing"),
    ("List the files in <d>, largest first.", "ls -S <d>", "listing"),
    ("List the files in <d>, newest first.", "ls -t <d>", "listing"),
    ("How many entries are there in <d>?", "ls <d> | wc -l", "number"),
    ("Show how much space <d> takes.", "du -sh <d>", "<x>K\t<d>"),
    ("Print the working directory.", "pwd", "<root>"),
    ("Print the contents of <f>. | Show <f>. | What does <f> say?", "cat <f>", "lines"),
    ("Show the first <n> lines of <f>.", "head -n <n> <f>", "lines"),
    ("Show the last <n> lines of <f>.", "tail -n <n> <f>", "lines"),
    ("Print line <n> of <f>.", "sed -n '<n>p' <f>", "lines"),
    ("Print lines <lo> to <hi> of <f>.", "sed -n '<lo>,<hi>p' <f>", "lines"),
    ("Show <f> with line numbers.", "cat -n <f>", "lines"),
    ("Print <f> without its first line.", "tail -n +2 <f>", "lines"),
    ("Print <f> with the last line first.", "tac <f>", "lines"),
    ("How many lines does <f> have?", "wc -l <f>", "count"),
    ("How many words are in <f>?", "wc -w <f>", "count"),
    ("What is the size of <f> in bytes?", "wc -c <f>", "count"),
    ("Save the line count of <f> into <o>. | Put the number of lines in <f> into <o>.", "wc -l < <f> > <o>", ""),
    ("Show the lines of <f> that contain `<w>`.", "grep '<w>' <f>", "lines"),
    ("Show the lines of <f> containing `<w>`, with line numbers.", "grep -n '<w>' <f>", "lines"),
    ("Find `<w>` in <f>, ignoring case.", "grep -i '<w>' <f>", "lines"),
    ("Show the lines of <f> that do not contain `<w>`.", "grep -v '<w>' <f>", "lines"),
    ("How many lines of <f> mention `<w>`?", "grep -c '<w>' <f>", "number"),
    ("Search every file under <d> for `<w>` and show where it appears.", "grep -rn '<w>' <d>", "<f>:<x>:<w>"),
    ("Save the lines of <f> that contain `<w>` to <o>.", "grep '<w>' <f> > <o>", ""),
    ("Which files in <d> end in .<e>?", "ls <d>/*.<e>", "<f>"),
    ("Print the files in <d> that mention `<w>`.", "grep -l '<w>' <d>/*", "<f>"),
    ("Sort the lines of <f> alphabetically.", "sort <f>", "lines"),
    ("Sort <f> numerically, largest first.", "sort -rn <f>", "lines"),
    ("Print the distinct lines of <f>.", "sort -u <f>", "lines"),
    ("Count how many times each line of <f> occurs.", "sort <f> | uniq -c", "lines"),
    ("Show the <n> most common lines of <f>.", "sort <f> | uniq -c | sort -rn | head -n <n>", "lines"),
    ("Write <f> sorted into <o>.", "sort <f> > <o>", ""),
    ("Print field <k> of every line of <f>; fields are separated by `<sep>`.", "cut -d'<sep>' -f<k> <f>", "lines"),
    ("Print the first <n> characters of every line of <f>.", "cut -c1-<n> <f>", "lines"),
    ("Print the <ord> whitespace-separated column of <f>.", "awk '{print $<k>}' <f>", "lines"),
    ("Print the lines of <f> whose <ord> column is greater than <x>.", "awk '$<k> > <x>' <f>", "lines"),
    ("Print the number of fields on each line of <f>.", "awk '{print NF}' <f>", "lines"),
    ("Print the largest number in column <k> of <f>.", "awk '$<k> > m {m = $<k>} END {print m}' <f>", "number"),
    ("Print the user names listed in /etc/passwd.", "cut -d: -f1 /etc/passwd", "root\nnobody\nwww-data"),
    ("Replace every `<a>` with `<b>` in <f>, editing the file in place.", "sed -i 's/<a>/<b>/g' <f>", ""),
    ("Print <f> with `<a>` replaced by `<b>`.", "sed 's/<a>/<b>/g' <f>", "lines"),
    ("Delete the lines of <f> that mention `<w>`, in place.", "sed -i '/<w>/d' <f>", ""),
    ("Print <f> in upper case.", "tr a-z A-Z < <f>", "lines"),
    ("Remove the carriage returns from <f> and save the result as <o>.", "tr -d '\\r' < <f> > <o>", ""),
    ("Print <f> with runs of spaces squeezed to one.", "tr -s ' ' < <f>", "lines"),
    ("Replace the commas in <f> with tabs and write it to <o>.", "tr ',' '\\t' < <f> > <o>", ""),
    ("Find every .<ce> file under <d>.", "find <d> -name '*.<ce>'", "<sub>/<dname>.<ce>"),
    ("List the directories under <d>.", "find <d> -type d", "<d>\n<sub>"),
    ("Find the files under <d> larger than <n> kilobytes.", "find <d> -type f -size +<n>k", "<f>"),
    ("Find the files under <d> changed in the last <n> days.", "find <d> -type f -mtime -<n>", "<f>"),
    ("How many files are there under <d>, counting subdirectories?", "find <d> -type f | wc -l", "number"),
    ("Delete every .<ce> file under <d>.", "find <d> -name '*.<ce>' -delete", ""),
    ("Find the file named <name> somewhere under <root>.", "find <root> -name '<name>'", "<f>"),
    ("Print the `<key>` field of the JSON object in <json>.", "jq '.<key>' <json>", '"<val>"'),
    ("Print the `<key>` field of <json> as raw text.", "jq -r '.<key>' <json>", "<val>"),
    ("How many elements does the JSON array in <json> have?", "jq 'length' <json>", "number"),
    ("List the keys of the JSON object in <json>.", "jq 'keys' <json>", '[\n  "<key>",\n  "<key2>"\n]'),
    ("Pretty-print <json>.", "jq . <json>", '{\n  "<key>": "<val>"\n}'),
    ("Print the first element of the JSON array in <json>.", "jq '.[0]' <json>", '{\n  "<key>": "<val>"\n}'),
    (
        "Print the records of <json> whose `<key>` is `<val>`.",
        "jq '.[] | select(.<key> == \"<val>\")' <json>",
        '{\n  "<key>": "<val>"\n}',
    ),
    ("Print the largest `<key>` in the JSON array <json>.", "jq 'map(.<key>) | max' <json>", "number"),
    ("Print the `<key>` of every record in <json>, one per line.", "jq -r '.[].<key>' <json>", "lines"),
    ("List the tables of the SQLite database <db>.", "sqlite3 <db> '.tables'", "<t>"),
    (
        "Show the schema of table `<t>` in <db>.",
        "sqlite3 <db> '.schema <t>'",
        "CREATE TABLE <t> (<c> TEXT, <c2> INTEGER);",
    ),
    ("How many rows does the table `<t>` of <db> have?", "sqlite3 <db> 'SELECT COUNT(*) FROM <t>;'", "number"),
    ("Show the first <n> rows of table `<t>` in <db>.", "sqlite3 <db> 'SELECT * FROM <t> LIMIT <n>;'", "lines"),
    (
        "Print the `<c>` of the rows of `<t>` in <db> whose `<c2>` is `<val>`.",
        "sqlite3 <db> \"SELECT <c> FROM <t> WHERE <c2> = '<val>';\"",
        "lines",
    ),
    ("Print the largest `<c>` in table `<t>` of <db>.", "sqlite3 <db> 'SELECT MAX(<c>) FROM <t>;'", "number"),
    (
        "Delete the rows of `<t>` in <db> whose `<c>` is below <x>.",
        "sqlite3 <db> 'DELETE FROM <t> WHERE <c> < <x>;'",
        "",
    ),
    (
        "Show the state of the git repository in <d>.",
        "git -C <d> status",
        "On branch main\nnothing to commit, working tree clean",
    ),
    ("Show the last <n> commits of the repository in <d>.", "git -C <d> log --oneline -n <n>", "a1b2c3d <msg>"),
    (
        "Create a branch called `<br>` in <d> and switch to it.",
        "cd <d> && git checkout -b <br>",
        "Switched to a new branch '<br>'",
    ),
    ("Show the uncommitted changes in <d>.", "git -C <d> diff", "lines"),
    ("Stage <name> in the git repository <d>.", "cd <d> && git add <name>", ""),
    (
        "Commit what is staged in <d> with the message `<msg>`.",
        "cd <d> && git commit -m '<msg>'",
        "[main a1b2c3d] <msg>",
    ),
    ("Start a new empty git repository in <d>.", "git init <d>", "Initialized empty Git repository in <d>/.git/"),
    ("List the branches of the repository in <d>.", "git -C <d> branch", "* main\n  <br>"),
    ("Show which files changed in the last commit of <d>.", "git -C <d> show --stat HEAD", "<msg>\n <name> | <x> +++"),
    ("Create the directory <sub>, with any missing parents.", "mkdir -p <sub>", ""),
    ("Rename <f> to <f2>.", "mv <f> <f2>", ""),
    ("Copy <f> to <g>.", "cp <f> <g>", ""),
    ("Copy the directory <d> and everything in it to <d2>.", "cp -r <d> <d2>", ""),
    ("Delete <f>.", "rm <f>", ""),
    ("Delete the directory <d> and everything in it.", "rm -r <d>", ""),
    ("Create an empty file <f>.", "touch <f>", ""),
    ("Make <script> executable.", "chmod +x <script>", ""),
    ("Create a directory <sub> holding an empty file <name>.", "mkdir -p <sub> && touch <sub>/<name>", ""),
    ("Make a symbolic link <g> that points to <f>.", "ln -s <f> <g>", ""),
    ("Write the text `<phrase>` to <o>.", "echo '<phrase>' > <o>", ""),
    ("Append the line `<phrase>` to <f>.", "echo '<phrase>' >> <f>", ""),
    ("Append the contents of <f> to <g>.", "cat <f> >> <g>", ""),
    ("Join <f> and <f2> into <o>.", "cat <f> <f2> > <o>", ""),
    ("Write today's date to <o>.", "date > <o>", ""),
    ("Write the numbers 1 to <n>, one per line, to <o>.", "seq 1 <n> > <o>", ""),
    ("Write the name of the current user to <o>.", "whoami > <o>", ""),
    ("Save the listing of <d> into <o>.", "ls <d> > <o>", ""),
    ("Show the newest file in <d>.", "ls -t <d> | head -n 1", "<name>"),
    ("Print the contents of the newest .<e> file in <d>.", 'cat "$(ls -t <d>/*.<e> | head -n 1)"', "lines"),
    ("Count the lines of all .<ce> files under <d> together.", "cat $(find <d> -name '*.<ce>') | wc -l", "number"),
    ("Print how many files in <d> end in .<e>.", "ls <d>/*.<e> | wc -l", "number"),
    ("Count the lines of each .<e> file in <d>.", "wc -l <d>/*.<e>", "count"),
    ("Show the processes whose command mentions <proc>.", "ps aux | grep <proc>", "root  <x>  0.0  <proc>"),
    ("Print the file name of <f> without its directory.", "basename <f>", "<name>"),
    ("Print the directory part of <f>.", "dirname <f>", "<d>"),
    ("Show the differences between <f> and <f2>.", "diff <f> <f2>", "lines"),
    ("Print the SHA-256 checksum of <f>.", "sha256sum <f>", "9f86d081884c7d65  <f>"),
    ("Show what kind of file <f> is.", "file <f>", "<f>: ASCII text"),
    ("Pack the directory <d> into the archive <tgz>.", "tar -czf <tgz> <d>", ""),
    ("Unpack the archive <tgz> into <d2>.", "mkdir -p <d2> && tar -xzf <tgz> -C <d2>", ""),
    ("Compress <f> with gzip.", "gzip <f>", ""),
    ("Show the environment variables whose name contains <var>.", "env | grep <var>", "<var>=<root>"),
    ("Print the value of the variable <var>.", 'echo "$<var>"', "<root>"),
    ("Say where the program <prog> is installed.", "which <prog>", "/usr/bin/<prog>"),
    ("Print the lines that the sorted files <f> and <f2> have in common.", "comm -12 <f> <f2>", "lines"),
    ("Print <f> and <f2> side by side.", "paste <f> <f2>", "lines"),
    ("Run the script <script>.", "bash <script>", "lines"),
    ("Print the current date and time.", "date", "Mon Jun  3 10:<x>:00 UTC 2025"),
    ("Show the free disk space.", "df -h", "/dev/vda1  20G  <x>G  <y>G  <x>% /"),
    ("Print the first line of every .<e> file in <d>.", "head -n 1 <d>/*.<e>", "lines"),
    ("Compute <x> times <y> with Python.", "python3 -c 'print(<x> * <y>)'", "number"),
    ("Print the sum of <x> and <y>.", "echo $((<x> + <y>))", "number"),
    ("Delete every file listed in <f>.", "xargs rm < <f>", ""),
    (
        "Print each .<e> file name in <d> followed by its first line.",
        'for f in <d>/*.<e>; do echo "$f"; head -n 1 "$f"; done',
        "lines",
    ),
    ("Check whether <f> exists.", "test -e <f> && echo yes || echo no", "yes"),
    ("Check whether <d> is a directory.", "[ -d <d> ] && echo yes || echo no", "no"),
)


def episodes(rng: random.Random, count: int, protocol: str = "raw_command") -> list[list[dict]]:
    """`count` conversations (user/assistant messages): raw_command ones end with the reply `exit`, terminus_2
    ones with the confirmed `task_complete`."""

    from tbexp.agents.base import Action, Turn
    from tbexp.agents.raw_command import DONE, RawCommandAgent
    from tbexp.sandboxes.base import ExecResult

    agent = RawCommandAgent(SimpleNamespace(observation_limit_chars=2000))
    banned = _builtin_names()
    pools = {
        name: [x for x in pool if x.lower() not in banned]
        for name, pool in (
            ("dirs", DIRS),
            ("stems", STEMS),
            ("words", WORDS),
            ("keys", KEYS),
            ("values", VALUES),
            ("tables", TABLES),
            ("columns", COLUMNS),
        )
    }
    conversations = []
    terminus = _TerminusWriter() if protocol == "terminus_2" else None
    for i in range(count):
        names = _Names(rng, pools, banned)
        instruction, steps = _episode(rng, names)
        # Every other terminus_2 episode stays raw_command, short and dense in what varies. Built on terminus_2
        # episodes alone (600 steps, every token in the loss), the model wrote "commands" for Harbor's "keystrokes"
        # key; this mix, with `_weights`, is what tiny_terminus was built with (the two not measured apart).
        if terminus and i % 2:
            conversations.append(terminus.conversation(instruction, steps))
            continue
        messages = [
            {"role": "user", "content": agent.prompt(SimpleNamespace(instruction=instruction, workdir=names.v["root"]))}
        ]
        for command, output, code in steps:
            turn = Turn(
                reply=command, action=Action(commands=[command]), results=[ExecResult(output=output, exit_code=code)]
            )
            messages += [{"role": "assistant", "content": command}, {"role": "user", "content": agent.observe(turn)}]
        messages.append({"role": "assistant", "content": DONE})
        conversations.append(messages)
    return conversations


class _TerminusWriter:
    """A chore as tbexp's terminus_2 agent shows it: Harbor's template and messages, the agent's own reply format
    and parser; the pane is drawn here (the command after the shell prompt, its output, the prompt again, blank
    rows to the pane's height), as `capture-pane` shows it for quick commands."""

    ROWS = 40  # the pane's height: Harbor's TmuxSession's
    SHELL = "root@vm:/app#"  # what the pane shows at a prompt in the built-in tasks' working directory

    def __init__(self):
        from tbexp.agents.terminus_2 import Terminus2Agent

        self.agent = Terminus2Agent(SimpleNamespace(parser="json", summarize=False))

    def pane(self, lines: list[str]) -> str:
        return "\n".join(lines) + "\n" * max(1, self.ROWS - len(lines))

    def first_prompt(self, instruction: str) -> str:
        return self.agent.prompt(
            SimpleNamespace(instruction=instruction), "Current Terminal Screen:\n" + self.pane([self.SHELL])
        )

    def first_command(self, reply: str) -> str:
        """The first command a reply types (its keystrokes without the newline), "" if it does not parse."""
        action = self.agent.parse(reply, [])
        return "" if action.error or not action.commands else action.commands[0].rstrip("\n")

    def conversation(self, instruction: str, steps: list[tuple[str, str, int]]) -> list[dict]:
        agent, history = self.agent, []
        messages = [{"role": "user", "content": self.first_prompt(instruction)}]
        for i, (command, output, _code) in enumerate(steps):
            shown = [f"{self.SHELL} {command}", *output.splitlines(), self.SHELL]
            # The first turn's output follows the start screen directly; later ones after a blank line.
            messages += self._turn(
                agent.format([command], done=False), ("" if i == 0 else "\n") + self.pane(shown), history
            )
        done = agent.format([], done=True)
        messages += self._turn(done, "\n" + self.pane([self.SHELL]), history)  # Harbor asks to confirm
        return messages + [{"role": "assistant", "content": done}]

    def _turn(self, reply: str, output: str, history: list) -> list[dict]:
        from tbexp.agents.base import Turn

        turn = Turn(reply, self.agent.parse(reply, history), screen="New Terminal Output:\n" + output)
        history.append(turn)
        return [{"role": "assistant", "content": reply}, {"role": "user", "content": self.agent.observe(turn)}]


def _episode(rng: random.Random, names: _Names) -> tuple[str, list[tuple[str, str, int]]]:
    """One chore: the instruction and its (command, output, exit code) steps."""
    v = names.v
    shape = rng.random()
    if shape < 0.12:  # look around, then act on what the listing showed
        return (
            names.fill(rng.choice(["Show the contents of the .<e> file in <d>.", "Print the only .<e> file in <d>."])),
            [
                (
                    names.fill("ls <d>"),
                    "\n".join([v["name"]] + [f for f in names.files[1:] if not f.endswith("." + v["e"])]),
                    0,
                ),
                (names.fill("cat <f>"), names.lines(), 0),
            ],
        )
    if shape < 0.2:  # search, then use the path the search printed
        return (
            names.fill("Find the file under <d> that mentions `<w>` and count its lines."),
            [
                (names.fill("grep -rn '<w>' <d>"), names.fill("<f>:<x>:<w> <phrase>"), 0),
                (names.fill("wc -l <f>"), f"{names.number()} {v['f']}", 0),
            ],
        )
    if shape < 0.26:  # a wrong guess, an error, then a look and the fix
        missing = f"{v['d']}/{rng.choice(names.pools['stems'])}.{v['e']}"
        return (
            names.fill("Print the .<e> file in <d>."),
            [
                (f"cat {missing}", f"cat: {missing}: No such file or directory", 1),
                (names.fill("ls <d>"), names.listing(), 0),
                (names.fill("cat <f>"), names.lines(), 0),
            ],
        )
    variants, command, output = rng.choice(TEMPLATES)
    instruction = names.fill(rng.choice(variants.split(" | ")))
    steps = [(names.fill(command), _output(names, output), 0)]
    if " > <o>" in command and rng.random() < 0.4:  # check the result
        steps.append((names.fill("cat <o>"), names.lines(), 0))
    elif rng.random() < 0.15:  # look first
        steps.insert(0, (names.fill("ls <d>"), names.listing(), 0))
    return instruction, steps


def _output(names: _Names, kind: str) -> str:
    if kind in ("lines", "listing", "number"):
        return getattr(names, kind)()
    if kind == "count":
        return f"{names.number()} {names.v['f']}"
    return names.fill(kind)


# --- tokenizer, model, training ----------------------------------------------------------------


def _weights(tokenizer, messages: list[dict], tokens: list[int]) -> list[float]:
    """Loss on every token but Harbor's fixed prompt text before the instruction: left in, those ~600 tokens, the
    same in every terminus_2 episode, would make the few that carry a name a tenth of each batch's mean."""
    head, found, _ = messages[0]["content"].partition(TERMINUS_INSTRUCTION_MARK)
    if not found:
        return [1.0] * len(tokens)
    fixed = 1 + len(tokenizer(head + found, add_special_tokens=False)["input_ids"])  # with the leading <|user|>
    return [0.0] * fixed + [1.0] * (len(tokens) - fixed)


def _train_tokenizer(corpus: list[list[dict]], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((m["content"] for messages in corpus for m in messages), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def _build_model(args, tokenizer) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.d_model,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        rope_theta=10000.0,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _train(
    model, examples: list[tuple[list[int], list[float]]], pad_id: int, args, steps: int, lr: float, bucket: bool
) -> list[float]:
    """AdamW on weighted next-token cross-entropy (mean over weighted tokens); returns the loss of each step."""
    model.to(args.device).train()
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    )
    losses, started = [], time.time()
    for step, chosen in enumerate(_batches(examples, args.batch, steps, random.Random(args.seed + 1), bucket)):
        tokens_B_T, weights_B_T, mask_B_T = _pad([examples[i] for i in chosen], pad_id, args.device)
        logits_B_T_V = model(input_ids=tokens_B_T[:, :-1], attention_mask=mask_B_T[:, :-1]).logits
        nll_B_T = torch.nn.functional.cross_entropy(logits_B_T_V.transpose(1, 2), tokens_B_T[:, 1:], reduction="none")
        weights = weights_B_T[:, 1:]
        loss = (nll_B_T * weights).sum() / weights.sum().clamp(min=1.0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if step % 25 == 0 or step == steps - 1:
            print(
                f"step {step:4d}  loss {_mean(losses[-25:]):.3f}  lr {schedule.get_last_lr()[0]:.2e}  {time.time() - started:.0f} s",
                flush=True,
            )
    return losses


def _batches(examples: list, batch: int, steps: int, rng: random.Random, bucket: bool) -> list[list[int]]:
    """`steps` batches of example indices, epoch after epoch, each epoch shuffled.

    With `bucket`, each window of 16 batches is sorted by length before it is cut, so a batch pads
    less (a third less compute here). Not for fine-tuning data of a few families: there, length
    tells the family apart, and single-family batches learn much worse.
    """
    batches: list[list[int]] = []
    while len(batches) < steps:
        order = rng.sample(range(len(examples)), len(examples))
        window = batch * 16 if bucket else len(order)
        epoch = []
        for start in range(0, len(order), window):
            chunk = order[start : start + window]
            if bucket:
                chunk.sort(key=lambda i: len(examples[i][0]))
            epoch += [chunk[i : i + batch] for i in range(0, len(chunk) - batch + 1, batch)]
        rng.shuffle(epoch)
        batches += epoch
    return batches[:steps]


def _pad(batch: list[tuple[list[int], list[float]]], pad_id: int, device: str):
    length = max(len(t) for t, _ in batch)
    tokens = torch.full((len(batch), length), pad_id, dtype=torch.long)
    weights = torch.zeros((len(batch), length))
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for i, (t, w) in enumerate(batch):
        tokens[i, : len(t)] = torch.tensor(t)
        weights[i, : len(w)] = torch.tensor(w)
        mask[i, : len(t)] = 1
    return tokens.to(device), weights.to(device), mask.to(device)


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


# --- saving ------------------------------------------------------------------------------------


def _save(model, tokenizer, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _describe(out: Path, c, vocab: int, record: dict) -> None:
    """README.md (what the model is, how it was built) and build.json (the numbers)."""
    check = record.get("check")
    measured = (
        ""
        if not check
        else f"""
Learnability (`--check`): the first command of the 40 held-out instances of train families is the oracle's
in {check["before/exact_train_families"]:.0%} of cases before SFT and {check["after/exact_train_families"]:.0%} after full fine-tuning on the 400 train
tasks' first commands ({record["check_steps"]} steps, batch {record["batch"]}); the 8 held-out-only instances: {check["before/exact_heldout_families"]:.0%} -> {check["after/exact_heldout_families"]:.0%}.
"""
    )
    terminus = record.get("protocol") == "terminus_2"
    name = PROTOCOL_DIRS[record.get("protocol", "raw_command")]
    what = "tbexp's built-in model for agent=terminus_2" if terminus else "tbexp's built-in model"
    selected = (
        f"`model={name}`, with `agent=terminus_2` (`+experiment=terminus_2`)"
        if terminus
        else f"`model={name}`,\nthe default"
    )
    corpus = (
        "terminus-2 episodes as\ntbexp's `agent=terminus_2` shows them (Harbor's prompt template with the instruction near its end, a\n"
        "40-row pane after each turn, JSON replies that type one command with `duration` 0.1, `task_complete` sent\n"
        "twice), about generic chores"
        if terminus
        else "raw_command episodes: one bash command per turn, made-up output with `[exit N]`,\n`exit` when done, about generic chores"
    )
    flags = f" --protocol {record['protocol']} --vocab {record['vocab']}" if terminus else ""
    (out / "README.md").write_text(f"""# {name}: {what}

A {record["params"] / 1e6:.2f}M-parameter `LlamaForCausalLM` (hidden {c.hidden_size}, {c.num_hidden_layers} layers,
{c.num_attention_heads} heads, MLP {c.intermediate_size}, tied embeddings) with a {vocab}-token byte-level BPE
tokenizer, trained from scratch so that tbexp runs end to end without downloading anything ({selected}: `load_model` resolves `model.path=""` to this directory).

It speaks the `plain` chat format of `tbexp/models/renderers.py`,
`<|user|>text<|end|><|assistant|>reply<|end|><|user|>...` (also its `chat_template`), and was pretrained
on a synthetic corpus of {corpus} (ls, cat, head/tail, wc, grep, sort/uniq, cut, awk, sed, tr, find,
jq, sqlite3, git, mkdir/mv/cp/rm, echo and redirections, pipes, `$(...)`, loops). The corpus avoids the
built-in task families' name pools, instructions and command templates: the model knows the protocol and
shell syntax, not the tasks, so what SFT and RL add is measurable.

Built with

    {BUILD_COMMAND}{flags} --seed {record["seed"]} --steps {record["steps"]}

{record["steps"]} steps of {record["batch"]} episodes, pretraining loss {record["loss_first"]:.2f} -> {record["loss_last"]:.2f}. A step takes
about {"1.4 s (half the episodes terminus-2's, of about 1,000 tokens)" if terminus else "0.15 s"} on 2 idle CPU cores, so the build takes {"23 minutes" if terminus else "a minute or two"}; this one took {record["build_s"]:.0f} s on
{record["threads"]} threads of a shared machine (`build.json`). The build is deterministic for a given seed,
CPU kind and torch version.
{measured}""")
    (out / "build.json").write_text(json.dumps(record, indent=1) + "\n")


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


# --- the learnability check -------------------------------------------------------------------


def check(args) -> dict[str, float]:
    """First-command exact match on the held-out tasks, before and after SFT on the train tasks' first commands."""
    from tbexp.agents.raw_command import RawCommandAgent
    from tbexp.tasks import load_tasks
    from tbexp.tasks.builtin import HELDOUT_FAMILIES, write_suite

    tokenizer = AutoTokenizer.from_pretrained(args.out)
    model = AutoModelForCausalLM.from_pretrained(args.out)
    renderer = make_renderer("plain", tokenizer)
    agent = RawCommandAgent(SimpleNamespace(observation_limit_chars=2000))
    terminus = _TerminusWriter() if args.protocol == "terminus_2" else None

    def prompt(task) -> str:
        return terminus.first_prompt(task.instruction) if terminus else agent.prompt(task)

    def reply(command: str) -> str:
        return terminus.agent.format([command], done=False) if terminus else command

    def command(reply: str) -> str:
        return terminus.first_command(reply) if terminus else reply.strip()

    with tempfile.TemporaryDirectory() as tmp:
        root = write_suite(Path(tmp) / "suite", seed=0)
        train, heldout = load_tasks(root / "train"), load_tasks(root / "heldout")
        first = {t.name: t.solution_script.read_text().splitlines()[1].strip() for t in train + heldout}
    seen = [t for t in heldout if t.family not in HELDOUT_FAMILIES]
    unseen = [t for t in heldout if t.family in HELDOUT_FAMILIES]

    def measure(label: str) -> dict[str, float]:
        greedy = _greedy(
            model, tokenizer, renderer, [prompt(t) for t in heldout], args.device, 200 if terminus else 120
        )
        replies = {t.name: command(r) for t, r in zip(heldout, greedy)}
        scores = {
            f"{label}/exact_train_families": _exact(seen, replies, first),
            f"{label}/exact_heldout_families": _exact(unseen, replies, first),
        }
        print(
            f"{label}: first command exactly the oracle's on {scores[f'{label}/exact_train_families']:.2f} of {len(seen)} held-out "
            f"instances of train families, {scores[f'{label}/exact_heldout_families']:.2f} of {len(unseen)} of held-out-only families"
        )
        for task in heldout[:: max(1, len(heldout) // 12)]:
            print(
                f"  {task.family:18s} model: {replies[task.name][:110]!r}\n  {'':18s} oracle: {first[task.name][:110]!r}"
            )
        return scores

    results = measure("before")
    if args.check_lora_rank:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(
            model, LoraConfig(r=args.check_lora_rank, lora_alpha=2 * args.check_lora_rank, target_modules=targets)
        )
    examples = [
        renderer.supervised(
            [{"role": "user", "content": prompt(t)}, {"role": "assistant", "content": reply(first[t.name])}]
        )
        for t in train
    ]
    started = time.time()
    _train(model, examples, tokenizer.pad_token_id, args, args.check_steps, args.check_lr, bucket=False)
    print(
        f"fine-tuned ({'LoRA rank %d' % args.check_lora_rank if args.check_lora_rank else 'full'}) {args.check_steps} steps in {time.time() - started:.0f} s"
    )
    return results | measure("after")


def _exact(tasks, replies: dict[str, str], first: dict[str, str]) -> float:
    return sum(replies[t.name] == first[t.name] for t in tasks) / max(1, len(tasks))


@torch.no_grad()
def _greedy(
    model, tokenizer, renderer, prompts: list[str], device: str, max_new_tokens: int = 120, batch: int = 16
) -> list[str]:
    model.to(device).eval()
    replies = []
    for start in range(0, len(prompts), batch):
        rendered = [renderer.initial_tokens(p) for p in prompts[start : start + batch]]
        length = max(map(len, rendered))
        ids = torch.tensor([[tokenizer.pad_token_id] * (length - len(r)) + r for r in rendered], device=device)
        mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rendered], device=device)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=renderer.stop(),
            pad_token_id=tokenizer.pad_token_id,
        )
        replies += [renderer.decode_reply(row[length:].tolist()) for row in out]
    model.train()
    return replies


if __name__ == "__main__":
    main()
