"""Token masks computed by xgrammar (the independent reference) along random walks, for
tests/unit/test_grammar_xgrammar.cpp.

For every case (a JSON schema, GBNF grammar, regex or json_object) and the tokenizer fixture's real
vocabulary, xgrammar compiles the constraint, then each walk repeatedly records the allowed-token
mask and commits a random allowed token (seeded), until the grammar is complete, nothing is allowed,
or the step limit. The C++ test replays each walk through kdtree's matcher and compares every mask
token by token. Masks are stored run-length encoded: alternating run lengths over token ids 0…V−1,
starting with a run of disallowed ids.

    build/venv-grammar/bin/python python/make_grammar_fixtures.py tests/fixtures/grammar/xgrammar_masks.json

(the venv: pip install xgrammar; it pulls in torch, which xgrammar's matcher uses for the bitmask.)
Special tokens are given to xgrammar as empty strings (not text), <|im_end|> is the stop token.
"""

import base64
import importlib.metadata
import json
import os
import platform
import random
import sys

import torch
import xgrammar as xgr

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = "tokenizer-kimi-small"

WEATHER = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["location", "unit"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "max_results": {"type": "integer"},
        "filters": {
            "type": "array",
            "items": {"type": "object", "properties": {"field": {"type": "string"}, "value": {"type": ["string", "number", "boolean", "null"]}},
                      "required": ["field", "value"], "additionalProperties": False},
            "maxItems": 3,
        },
    },
    "required": ["query"],
    "additionalProperties": False,
}
TREE = {
    "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
                       "required": ["v", "kids"], "additionalProperties": False}},
    "$ref": "#/$defs/node",
}

CASES = [
    ("object_compact", "json_schema", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "number"}},
                                       "required": ["a"]}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("object_ws", "json_schema", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
                                  "required": ["b"]}, {"any_whitespace": True}),
    ("tool_weather", "json_schema", WEATHER, {"any_whitespace": False, "separators": [", ", ": "]}),
    ("tool_search", "json_schema", SEARCH, {"any_whitespace": True}),
    ("tree_ref", "json_schema", TREE, {"any_whitespace": False, "separators": [",", ":"]}),
    ("any_of", "json_schema", {"type": "array", "items": {"anyOf": [{"type": "string", "maxLength": 3}, {"type": "integer"}, {"type": "null"}]},
                               "minItems": 1, "maxItems": 4}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("enum_const", "json_schema", {"type": "object", "properties": {"k": {"const": "fixed"}, "e": {"enum": ["x", 1, True, None, "y z"]}},
                                   "required": ["k", "e"], "additionalProperties": False}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("string_lengths", "json_schema", {"type": "string", "minLength": 2, "maxLength": 5}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("extra_props", "json_schema", {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"],
                                    "additionalProperties": {"type": "boolean"}}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("pattern", "json_schema", {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]+$"}, {"any_whitespace": False, "separators": [",", ":"]}),
    ("json_object", "json_object", None, {"any_whitespace": True}),
    ("gbnf_arith", "gbnf", 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\n'
                           'factor ::= [0-9]+ | "(" expr ")"\n', {}),
    ("gbnf_unicode", "gbnf", 'root ::= "<" word (" " word)* ">"\nword ::= [a-zα-ωа-я\\u4e00-\\u9fff]+\n', {}),
    ("gbnf_negated", "gbnf", 'root ::= "\\"" [^"\\n]* "\\"" [.!?]\n', {}),
    ("regex_code", "regex", "[0-9]{3}-[A-Z]{2}(x|yz)*", {}),
    ("regex_email", "regex", "[a-z]+(\\.[a-z]+)?@[a-z]+\\.(com|org)", {}),
]


def load_vocab():
    d = os.path.join(ROOT, "tests", "fixtures", TOKENIZER)
    vocab = {}
    with open(os.path.join(d, "tiktoken.model"), "rb") as f:
        for line in f:
            tok, rank = line.split()
            vocab[int(rank)] = base64.b64decode(tok)
    n_base = len(vocab)
    with open(os.path.join(d, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    names = {int(k): v["content"] for k, v in cfg["added_tokens_decoder"].items()}
    size = n_base + 256
    encoded = [vocab[i] if i < n_base else b"" for i in range(size)]
    stop = [i for i, n in names.items() if n == "<|im_end|>"]
    return encoded, n_base, stop


def rle(bits):
    runs, cur, n = [], False, 0
    for b in bits:
        if b == cur:
            n += 1
        else:
            runs.append(n)
            cur, n = b, 1
    runs.append(n)
    return runs


def compile_case(compiler, kind, spec, opts):
    if kind == "json_schema":
        return compiler.compile_json_schema(json.dumps(spec), any_whitespace=opts["any_whitespace"],
                                            separators=tuple(opts["separators"]) if "separators" in opts else None, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema(json.dumps({"type": "object"}), any_whitespace=opts["any_whitespace"], strict_mode=False)
    if kind == "gbnf":
        return compiler.compile_grammar(spec)
    if kind == "regex":
        return compiler.compile_regex(spec)
    raise ValueError(kind)


def main():
    out = sys.argv[1]
    encoded, n_base, stop = load_vocab()
    size = len(encoded)
    info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=size, stop_token_ids=stop)
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    rng = random.Random(20)
    structural = set(b'"{}[],:0123456789-. ')
    cases = []
    for name, kind, spec, opts in CASES:
        compiled = compile_case(compiler, kind, spec, opts)
        walks = []
        for _ in range(4):
            m = xgr.GrammarMatcher(compiled)
            bm = xgr.allocate_token_bitmask(1, size)
            tokens, masks = [], []
            for _step in range(32):
                m.fill_next_token_bitmask(bm)
                words = bm[0].tolist()
                bits = [bool((words[i >> 5] >> (i & 31)) & 1) for i in range(size)]
                masks.append(rle(bits))
                allowed = [i for i in range(size) if bits[i]]
                if not allowed or m.is_terminated():
                    break
                text = [i for i in allowed if i < n_base and (len(encoded[i]) == 1 or structural & set(encoded[i]))]
                pick = rng.choice(text) if text and rng.random() < 0.6 else rng.choice(allowed)
                if pick in stop:
                    break
                assert m.accept_token(pick), (name, pick)
                tokens.append(pick)
            walks.append({"tokens": tokens, "masks": masks})
        case = {"name": name, "kind": kind, "options": opts, "walks": walks}
        if kind in ("json_schema",):
            case["schema"] = spec
        elif kind in ("gbnf", "regex"):
            case["source"] = spec
        cases.append(case)
    doc = {
        "made_by": "python/make_grammar_fixtures.py",
        "versions": {"xgrammar": importlib.metadata.version("xgrammar"), "torch": torch.__version__, "python": platform.python_version()},
        "tokenizer": TOKENIZER,
        "vocab_size": size,
        "stop_ids": stop,
        "note": "special tokens given to xgrammar as empty strings; masks run-length encoded, first run disallowed",
        "cases": cases,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"{out}: {len(cases)} cases, {sum(len(w['masks']) for c in cases for w in c['walks'])} masks", file=sys.stderr)


if __name__ == "__main__":
    main()
