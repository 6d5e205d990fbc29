"""One Constraint compiled by xgrammar against one tokenizer's token strings.

`build_compiler` reads a tokenizer's whole vocabulary into xgrammar's table (~0.2 s on SmolLM2's);
`compile_constraint` compiles a constraint with it and refuses, naming the field, what xgrammar
rejects, JSON-schema keywords it does not enforce (engine/schema_keywords.py) and grammars that
admit no output at all. engine/grammar_cache.py decides which tokenizer a request's constraint is
compiled against (the base's, or its adapter's own) and keeps the results.
"""

from __future__ import annotations

import json
import re

from loraplex.services.inference.engine.grammar import allocate_bitmask
from loraplex.services.inference.engine.schema_keywords import check_schema_keywords
from loraplex.services.inference.engine.types import Constraint
from loraplex.services.inference.errors import InvalidRequest

# "Any JSON object", written the way json_schema output is (", " and ": ", no other whitespace)
# and with numbers of at most 16 integer and 16 fraction digits: xgrammar's built-in JSON grammar
# lets a small model write digits for ever (seen on SmolLM2: "population": 2000000000...).
JSON_OBJECT_GRAMMAR = r"""root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ( member ( ", " member )* )? "}"
member ::= string ": " value
array ::= "[" ( value ( ", " value )* )? "]"
string ::= "\"" char* "\""
char ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )
number ::= "-"? int frac? exp?
int ::= "0" | [1-9] [0-9]{0,15}
frac ::= "." [0-9]{1,16}
exp ::= [eE] [+-]? [0-9]{1,3}
"""
_CPP_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def _parser_message(exc: Exception) -> str:
    """xgrammar's error text without its C++ source location prefix."""
    return _CPP_PREFIX.sub("", str(exc).strip()).strip()


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF whose language is exactly `choices` (JSON string escapes are valid EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def build_compiler(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's compiler on `tokenizer`'s token strings, masks `vocab_size` wide (the model's
    logits, which may be wider than the tokenizer)."""
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    # No cache of xgrammar's own (unbounded by default): GrammarCache keeps a bounded one.
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def compile_constraint(compiler, c: Constraint, vocab_size: int):
    """`c` compiled by `compiler`; InvalidRequest naming `c.field` when it is refused."""
    try:
        if c.kind == "json_schema":
            try:
                schema = json.loads(c.value)
            except ValueError as exc:
                raise InvalidRequest(f"{c.field} is not valid JSON: {exc}", field=c.field) from None
            check_schema_keywords(schema, c.field)
            compiled = compiler.compile_json_schema(
                c.value, any_whitespace=c.any_whitespace, strict_mode=True
            )
        elif c.kind == "json_object":
            if c.any_whitespace:
                compiled = compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
            else:
                compiled = compiler.compile_grammar(JSON_OBJECT_GRAMMAR)
        elif c.kind == "regex":
            compiled = compiler.compile_regex(c.value)
        elif c.kind == "choice":
            compiled = compiler.compile_grammar(choice_grammar(c.choices))
        else:
            compiled = compiler.compile_grammar(c.value)
    except (RuntimeError, ValueError, TypeError) as exc:
        if isinstance(exc, InvalidRequest):
            raise
        raise InvalidRequest(f"{c.field} is invalid: {_parser_message(exc)}", field=c.field) from None
    if not admits_output(compiled, vocab_size):
        raise InvalidRequest(
            f"{c.field} admits no output: no token can start it (a rule that only refers to "
            "itself, an empty character class, a schema that is only a reference to itself)",
            field=c.field,
        )
    return compiled


def admits_output(compiled, vocab_size: int) -> bool:
    """Whether any token (a stop token included, where the empty output is allowed) may come first."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = allocate_bitmask(1, vocab_size, pin=False)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any())
