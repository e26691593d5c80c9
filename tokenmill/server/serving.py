"""The server's state in one class: the engine client, the tokenizer, the
metrics and the served names. Routes get it as a `ServingDep` parameter and
keep only the HTTP shaping; everything two routes share lives here.

`engine` is the one attribute that talks to the engine: the in-process
`AsyncEngine` or the `CoreClient` of an engine core process (both an
`EngineClient`); nothing else here reaches past it.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Annotated, Any

from fastapi import Depends, Request

from tokenmill.engine.core.outputs import RequestOutput
from tokenmill.engine.core.server_info import server_info
from tokenmill.engine.core.validation import RequestError, RequestValidator
from tokenmill.engine.frontend.engine_client import EngineClient
from tokenmill.engine.frontend.request_stream import (
    EngineDiedError,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
    StreamBehindError,
)
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol as p
from tokenmill.server.chat_template import NO_TEMPLATE, content_format, template_of
from tokenmill.server.constraints import check_compiles, with_constraints
from tokenmill.server.errors import APIError, check_text
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.progress import Progress
from tokenmill.server.reasoning import get_reasoning_parser
from tokenmill.server.responses.store import ResponseStore
from tokenmill.server.serving_config import ServingConfig
from tokenmill.server.streams import Part, merge
from tokenmill.server.tokenizer_pool import TokenizerPool, max_token_bytes
from tokenmill.server.tool_calls import ToolPlan, template_knows_tools
from tokenmill.server.tool_calls import conversation as tool_conversation
from tokenmill.structured.compiler import GrammarCache

logger = logging.getLogger(__name__)

MAX_PROMPTS = 2048  # per completion request, as OpenAI
# apply_chat_template arguments the server sets itself
_RESERVED_TEMPLATE_KWARGS = {"conversation", "chat_template", "tokenize", "return_dict",
                             "add_generation_prompt", "continue_final_message", "tools"}


class Serving:
    def __init__(self, engine: EngineClient, served_model_name: str | list[str] | None = None,
                 config: ServingConfig | None = None) -> None:
        llm = engine.engine
        self.engine = engine
        self.config = config or ServingConfig()
        self.tokenizer = llm.tokenizer
        self.root_model_name: str = llm.model_name
        names = [served_model_name] if isinstance(served_model_name, str) else \
            list(served_model_name or [])
        # as vLLM: requests may name any of them; responses carry the first
        self.model_names: list[str] = names or [llm.model_name]
        self.model_name: str = self.model_names[0]
        self.vocab_size: int = llm.model_config.vocab_size
        self.max_model_len: int = llm.max_model_len
        # the engine's own request checks (engine/core/validation.py), run here on the
        # fields the server reads before the engine sees them
        self.validator = RequestValidator(self.tokenizer, self.vocab_size, self.max_model_len)
        self.metrics = ServerMetrics(lambda: engine.stats, self.model_name,
                                     self.config.metrics_prefix,
                                     core_pid=getattr(engine, "core_pid", None),
                                     cache_config=cache_config_of(llm))
        self.chat_template = template_of(self.tokenizer, self.config.chat_template)
        self.content_format = content_format(self.config.chat_template_content_format,
                                             self.chat_template)
        self.tokenizers = TokenizerPool(self.tokenizer, self.config.tokenizer_workers)
        self.tokenizers_max_token_bytes = max_token_bytes(self.tokenizer)
        self.max_prompt_bytes = self.max_model_len * self.tokenizers_max_token_bytes
        # compiles structured-output constraints, cached: the engine's own in-process;
        # beside an engine core process, one here too, so that a schema that cannot
        # compile is a 400 before the request is sent (the core compiles its own copy)
        self.grammars = getattr(llm, "grammars", None) or GrammarCache(
            self.tokenizer, self.vocab_size, getattr(llm, "eos_token_ids", ()))
        self.template_knows_tools = template_knows_tools(self.chat_template)
        self._token_text: dict[int, str] = {}
        self.reasoning_parser = get_reasoning_parser(self.config.reasoning_parser) \
            if self.config.reasoning_parser else None
        self.responses = ResponseStore(self.config.responses_store_size)

    # ---- request validation and rendering ------------------------------------------

    def lora_names(self) -> list[str]:
        manager = getattr(self.engine.engine, "lora", None)
        return list(manager.served) if manager is not None else []

    def check_model(self, name: str | None) -> str:
        """The name a response carries (as vLLM: the adapter's for an adapter request,
        else the first served name); 404 for a name this server does not serve."""
        from tokenmill.server.routes.lora import current_lora

        current_lora.set(None)
        manager = getattr(self.engine.engine, "lora", None)
        if name is not None and manager is not None and name not in self.model_names:
            lora = manager.lookup(name)
            if lora is not None:  # the request runs under this adapter
                current_lora.set(lora)
                return name
        if name is not None and name not in self.model_names:
            served = ", ".join(repr(n) for n in [*self.model_names, *self.lora_names()])
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{served}", param="model", code="model_not_found")
        return self.model_name

    def check_token_ids(self, ids: list[int], param: str, what: str = "token ids") -> None:
        try:
            self.validator.check_token_ids(ids, param, what)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    def sampling_params(self, req: p.CompletionRequest | p.ChatCompletionRequest
                        ) -> SamplingParams:
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids", "stop_token_ids")
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            check_text(s, "stop")
        try:
            params = req.to_sampling_params(self.config.generation_defaults)
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        return with_constraints(req, params)

    def check_prompt_bytes(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit: no token spells
        more than `max_token_bytes`, so it has at least bytes / that many tokens."""
        if len(text) * 4 <= self.max_prompt_bytes:
            return  # no character is over 4 bytes: it cannot be too long
        # a character is at least one byte, so a long text is refused without encoding it
        num_bytes = len(text) if len(text) > self.max_prompt_bytes else \
            len(text.encode("utf-8", "surrogatepass"))
        if num_bytes > self.max_prompt_bytes:
            at_least = num_bytes // self.tokenizers_max_token_bytes
            raise APIError(400, f"this model's maximum context length is "
                           f"{self.max_model_len} tokens; the prompt (at least {num_bytes} bytes) has "
                           f"at least {at_least} tokens. Reduce the prompt.", param=param)

    async def render_chat(self, messages: list[p.ChatMessage], options: p.ChatTemplateFields,
                          tools: ToolPlan | None = None) -> list[int]:
        if self.chat_template is None:
            raise APIError(400, NO_TEMPLATE, param="messages", code="no_chat_template")
        if options.chat_template is not None:
            raise APIError(400, "a per-request chat_template is not supported; start the "
                           "server with --chat-template FILE", param="chat_template")
        try:
            options.check_messages(messages)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        conversation = tool_conversation(messages, tools, self.template_knows_tools,
                                         self.content_format)
        for i, m in enumerate(messages):
            check_text(m.text(), f"messages.{i}.content")
        self.check_prompt_bytes("".join(m.text() for m in messages), "messages")
        extra = dict(options.chat_template_kwargs or {})
        reserved = sorted(set(extra) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}",
                           param="chat_template_kwargs")
        if options.documents is not None:
            extra["documents"] = options.documents
        if tools is not None and self.template_knows_tools:
            extra["tools"] = tools.tools
        try:
            return await self.tokenizers.render_chat(
                conversation, chat_template=self.chat_template,
                add_generation_prompt=options.add_generation_prompt,
                continue_final_message=options.continue_final_message, **extra)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError/SecurityError
            raise APIError(400, f"cannot apply the chat template: {str(e)[:300]}",
                           param="messages") from None

    async def encode(self, text: str, add_special_tokens: bool = True,
                     param: str = "prompt") -> list[int]:
        self.check_prompt_bytes(text, param)
        check_text(text, param)
        return await self.tokenizers.encode(text, add_special_tokens)

    async def decode(self, token_ids: list[int]) -> str:
        return await self.tokenizers.decode(token_ids)

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion_prompts(self, req: p.CompletionRequest) -> list[str | list[int]]:
        """The prompts of a completion request: one, or a batch (each gets n choices)."""
        prompt: Any = req.prompt
        batch = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) \
            else list(prompt)
        if not batch:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(batch) > MAX_PROMPTS:
            raise APIError(400, f"at most {MAX_PROMPTS} prompts per request, got {len(batch)}",
                           param="prompt")
        for i, one in enumerate(batch):
            param = self._prompt_param(i, len(batch))
            if isinstance(one, str):
                self.check_prompt_bytes(one, param)  # first: it is the cheaper check
                check_text(one, param)
            else:
                self.check_token_ids(one, param, "prompt token ids")
            if not one:
                raise APIError(400, f"{param} is empty", param=param)
        return batch

    async def prompt_token_ids(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Text prompts tokenized in the pool (with the tokenizer's special tokens,
        as the engine would), token-id prompts as they are."""
        async def one(i: int, prompt: str | list[int]) -> list[int]:
            if not isinstance(prompt, str):
                return prompt
            return await self.encode(prompt, True, self._prompt_param(i, len(prompts)))

        return list(await asyncio.gather(*(one(i, x) for i, x in enumerate(prompts))))

    @staticmethod
    def _prompt_param(i: int, batch_size: int) -> str:
        return "prompt" if batch_size == 1 else f"prompt.{i}"

    # ---- the engine ----------------------------------------------------------------

    def progress(self, n: int, object_name: str, max_tokens: int | None = None) -> Progress:
        return Progress(n, self.metrics, object_name, max_tokens)

    async def submit(self, request_id: str, prompt: str | list[int],
                     params: SamplingParams,
                     arrival_time: float | None = None) -> RequestStream:
        await check_compiles(self.grammars, params.structured_outputs)
        try:
            from tokenmill.server.routes.lora import current_lora

            lora = current_lora.get()
            if lora is not None:  # only clients that serve adapters take the argument
                return await self.engine.add_request(request_id, prompt, params,
                                                     arrival_time=arrival_time,
                                                     lora_request=lora)
            return await self.engine.add_request(request_id, prompt, params,
                                                 arrival_time=arrival_time)
        except QueueFullError as e:
            raise APIError(503, str(e), "service_unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineUnavailableError as e:  # shutting down, or the core is down
            raise APIError(503, str(e), "service_unavailable_error", code="unavailable",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    async def submit_all(self, request_id: str, prompts: list[str | list[int]],
                         params: SamplingParams, object_name: str,
                         arrival_time: float | None = None) -> list[Part]:
        """One engine request per prompt, tokenized here (never on the engine loop);
        if one is refused, the others are aborted. arrival_time: when the route got
        the request (time.monotonic), so TTFT and queue time include tokenization."""
        prompt_ids = await self.prompt_token_ids(prompts)
        if self.config.log_prompts:
            for prompt, ids in zip(prompts, prompt_ids):
                text = prompt if isinstance(prompt, str) else await self.decode(ids)
                logger.info("request %s: %d prompt tokens, n=%d, max_tokens=%s, prompt: %r",
                            request_id, len(ids), params.n, params.max_tokens, text[:4000])
        parts: list[Part] = []
        try:
            for i, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                stream = await self.submit(rid, ids, params, arrival_time)
                progress = self.progress(params.n, object_name, params.max_tokens)
                parts.append(Part(stream, progress, prompt,
                                  i * params.n))
        except BaseException:
            for part in parts:
                self.engine.abort(part.stream.request_id)
            raise
        return parts

    async def collect(self, request: Request, parts: list[Part]) -> list[RequestOutput]:
        """Run non-streamed requests to the end; abort them if the client leaves."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request, parts))
        finals: dict[int, RequestOutput] = {}
        try:
            async with aclosing(merge(parts)) as outputs:
                async for part, out in outputs:
                    part.progress.observe(out)
                    finals[id(part)] = out
        except EngineDiedError as e:
            raise APIError(503, str(e), "service_unavailable_error", code="engine_down",
                           headers={"Retry-After": "5"}) from None
        except StreamBehindError as e:
            raise APIError(503, str(e), "service_unavailable_error",
                           code="stream_too_slow") from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "service_unavailable_error",
                           code="unavailable") from None
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            watcher.cancel()
            for part in parts:
                part.progress.end(part.stream, self.engine)
        outs = [finals.get(id(part)) for part in parts]
        if any(out is None or not out.finished for out in outs):
            raise APIError(503, "the request was aborted before it finished (server "
                           "shutting down)", "service_unavailable_error", code="aborted")
        return [out for out in outs if out is not None]

    async def _abort_on_disconnect(self, request: Request, parts: list[Part]) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                for part in parts:
                    self.engine.abort(part.stream.request_id)
                return

    def usage(self, outs: list[RequestOutput], prompt_only: bool = False) -> p.UsageInfo:
        """Summed over the prompts of a batch; `prompt_only`: the token generated to
        score a max_tokens=0 prompt is not counted (nor returned)."""
        prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
        completion_tokens = 0 if prompt_only else sum(
            len(c.token_ids) for out in outs for c in out.outputs)
        details = None
        if self.config.enable_prompt_tokens_details:
            details = p.PromptTokensDetails(
                cached_tokens=sum(out.num_cached_tokens for out in outs))
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details=details)


def cache_config_of(llm: Any) -> dict[str, Any] | None:
    """The KV-cache settings for cache_config_info, with vLLM's label names."""
    info = getattr(llm, "server_info", None)
    if not isinstance(info, dict):
        try:
            info = server_info(llm)
        except AttributeError:  # an engine without a config (a test double)
            return None
    return {"block_size": info.get("block_size"), "cache_dtype": info.get("kv_cache_dtype"),
            "enable_prefix_caching": info.get("enable_prefix_caching"),
            "num_gpu_blocks": info.get("num_kv_blocks"),
            "kv_cache_memory_bytes": info.get("kv_cache_memory_bytes")}


def get_serving(request: Request) -> Serving:
    """The FastAPI dependency routes use to reach the app's one `Serving`."""
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]
