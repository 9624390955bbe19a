#!/usr/bin/env python3
"""Regenerates specd's reference fixtures from llama.cpp, an independent implementation.

  python3 scripts/reference/make_fixtures.py [MODEL.gguf]

Builds llama.cpp with ../shared/peers/build-llama-cpp.sh (cached), compiles
llama_reference.c against it, and writes
  model/tests/fixtures/tokenizer_smollm2.json  (ids of >= 30 strings)
  model/tests/fixtures/reference_smollm2.json  (greedy continuations and top-5 logits)
The default MODEL is the cached default model (~/.cache/specd/models or $SPECD_MODEL_DIR).
"""
import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "model" / "tests" / "fixtures"
GREEDY_TOKENS = 40
TOP_K = 5

TOKENIZER_CASES = [
    "Hello world",
    "hello world",
    " Hello world",
    "  two leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "\tTabbed\tline",
    "line one\nline two\n\nline four",
    "1234567890",
    "Version 3.14159 released in 2024!",
    "x = 42 + 7 * (3 - 1)",
    "café résumé naïve",
    "日本語のテキスト",
    "Emoji: 😀🚀👍🏽",
    "Ünïcödé mixed with ASCII",
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n    println!(\"hi\");\n}",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more",
    "It's, they're, we've, I'm, you'll, he'd.",
    "Don't STOP believing",
    "https://example.com/path?query=1&x=y",
    "user@example.com",
    "{\"name\": \"specd\", \"version\": 1, \"tags\": [\"a\", \"b\"]}",
    "    indented code block",
    "Ends with newline\n",
    "MiXeD CaSe WoRdS",
    "a",
    " ",
    "\n",
    "The quick brown fox jumps over the lazy dog.",
    "Ω≈ç√∫˜µ≤≥÷",
    "Speculative decoding accepts draft tokens.",
]

PROMPTS = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The history of the Roman Empire",
    "def fibonacci(n):\n",
    "<|im_start|>user\nList three colors.<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5, 6,",
    "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n",
    "<|im_start|>user\nWhat is 12 times 12?<|im_end|>\n<|im_start|>assistant\n",
    "The days of the week are Monday, Tuesday,",
]


def default_model() -> pathlib.Path:
    base = os.environ.get("SPECD_MODEL_DIR")
    if base:
        return pathlib.Path(base) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache = os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))
    return pathlib.Path(cache) / "specd" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def build_reference() -> tuple[pathlib.Path, pathlib.Path]:
    script = ROOT.parent / "shared" / "peers" / "build-llama-cpp.sh"
    bindir = pathlib.Path(subprocess.check_output(["bash", str(script)], text=True).strip().splitlines()[-1])
    src = bindir.parents[1]
    exe = bindir / "specd_llama_reference"
    subprocess.check_call([
        "gcc", "-O2", "-o", str(exe), str(pathlib.Path(__file__).with_name("llama_reference.c")),
        f"-I{src / 'include'}", f"-I{src / 'ggml' / 'include'}", f"-L{bindir}",
        "-lllama", "-lggml", "-lggml-base",
    ])
    return exe, bindir


def run(exe, bindir, model, args, texts):
    env = dict(os.environ, LD_LIBRARY_PATH=str(bindir))
    data = b"\0".join(t.encode() for t in texts)
    out = subprocess.run([str(exe), str(model), *args], input=data, env=env,
                         capture_output=True, check=True)
    return out.stdout.decode().splitlines()


def main():
    model = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else default_model()
    exe, bindir = build_reference()
    lines = run(exe, bindir, model, ["tokenize"], TOKENIZER_CASES)
    cases = [{"text": t, "ids": [int(x) for x in line.split()]} for t, line in zip(TOKENIZER_CASES, lines)]
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "tokenizer_smollm2.json").write_text(json.dumps(
        {"source": "llama.cpp llama_tokenize(add_special=true, parse_special=true)", "cases": cases},
        ensure_ascii=False, indent=1) + "\n")

    lines = run(exe, bindir, model, ["generate", str(GREEDY_TOKENS), str(TOP_K)], PROMPTS)
    prompts, current = [], None
    for line in lines:
        kind, _, rest = line.partition(" ")
        if kind == "prompt":
            current = {"text": PROMPTS[len(prompts)], "ids": [int(x) for x in rest.split()], "top": []}
            prompts.append(current)
        elif kind == "top":
            pos, *pairs = rest.split()
            current["top"].append({"pos": int(pos), "ids": [int(p.split(":")[0]) for p in pairs],
                                   "logits": [float(p.split(":")[1]) for p in pairs]})
        elif kind == "greedy":
            pairs = [p.split(":") for p in rest.split()]
            current["greedy"] = [int(i) for i, _ in pairs]
            current["greedy_margins"] = [float(m) for _, m in pairs]
    (FIXTURES / "reference_smollm2.json").write_text(json.dumps(
        {"source": "llama.cpp, 2 threads, batched prompt decode, greedy one token per decode",
         "prompts": prompts}, ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {len(cases)} tokenizer cases and {len(prompts)} reference prompts to {FIXTURES}")


if __name__ == "__main__":
    main()
