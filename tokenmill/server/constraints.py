"""Request fields -> the SamplingParams constraints (tokenmill/structured).

OpenAI's `response_format`, vLLM's `structured_outputs` and its older
`guided_*` names all become one `StructuredOutputsParams`; giving two of
them is a 400 rather than a silent pick. `logit_bias`, `allowed_token_ids`
and `bad_words` pass through. Compiles are awaited here, before the request
reaches the engine, so a bad schema is a 400 and not a failed stream.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams
from tokenmill.server.errors import APIError, check_text


def requested_constraint(req: Any) -> StructuredOutputsParams | None:
    """The output constraint a completion or chat request asks for, if any
    (its `param` names the request field)."""
    given: list[tuple[str, dict[str, Any]]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required for "
                           "type json_schema", param="response_format.json_schema")
        given.append(("response_format", {"json": rf.json_schema.schema_}))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        given.append(("structured_outputs", {
            "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": bool(so.json_object)}))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                      ("guided_choice", "choice"), ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given.append((name, {key: getattr(req, name)}))
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, "give one output constraint, not several: "
                       + ", ".join(name for name, _ in given), param=given[1][0])
    field, kwargs = given[0]
    texts = [v for v in kwargs.values() if isinstance(v, str)] + list(kwargs.get("choice") or [])
    for text in texts:
        check_text(text, field)
    try:
        return StructuredOutputsParams(**kwargs, param=field)
    except ValueError as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def with_constraints(req: Any, params: SamplingParams) -> SamplingParams:
    """`params` plus the request's output constraint and token constraints."""
    constraint = requested_constraint(req)
    for word in req.bad_words or []:
        check_text(word, "bad_words")
    bias = None
    if req.logit_bias:
        try:
            bias = {int(token): value for token, value in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    try:
        return dataclasses.replace(params, structured_outputs=constraint, logit_bias=bias,
                                   allowed_token_ids=req.allowed_token_ids,
                                   bad_words=list(req.bad_words or []))
    except ValueError as e:
        raise APIError(400, str(e), param=getattr(e, "param", None)) from None


async def check_compiles(grammars: Any, constraint: StructuredOutputsParams | None) -> None:
    """Wait (off the event loop's thread) for the grammar; a 400 if it does not compile."""
    if constraint is None:
        return
    try:
        await asyncio.wrap_future(grammars.submit(constraint))
    except ValueError as e:
        raise APIError(400, f"{constraint.param}: {e}", param=getattr(e, "param", None)) from None
