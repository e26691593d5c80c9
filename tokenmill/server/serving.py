"""The server's state in one class: the engine client, the tokenizer, the
metrics and the served names. Routes get it as a `ServingDep` parameter and
keep only the HTTP shaping; everything two routes share lives here.

`engine` is the one attribute that talks to the engine (today the in-process
`AsyncEngine`); nothing else here reaches past it.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import Depends, Request

from tokenmill.engine.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
)
from tokenmill.engine.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server import protocol as p
from tokenmill.server.constraints import check_compiles, with_constraints
from tokenmill.server.errors import APIError, check_text
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.progress import Progress
from tokenmill.server.tool_calls import ToolPlan, template_knows_tools
from tokenmill.server.tool_calls import conversation as tool_conversation


class Serving:
    def __init__(self, engine: AsyncEngine, served_model_name: str | None = None) -> None:
        llm = engine.engine
        self.engine = engine
        self.tokenizer = llm.tokenizer
        self.root_model_name: str = llm.model_name
        self.model_name: str = served_model_name or llm.model_name
        self.vocab_size: int = llm.model_config.vocab_size
        self.max_model_len: int = llm.max_model_len
        self.metrics = ServerMetrics(lambda: engine.stats, self.model_name)
        self.grammars = llm.grammars  # compiles structured-output constraints, cached
        self.tool_call_parser: str | None = None  # --tool-call-parser, with auto tool choice
        self.template_knows_tools = template_knows_tools(self.tokenizer)
        self._token_text: dict[int, str] = {}

    # ---- request validation and rendering ------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                           f"{self.model_name!r}", param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str, what: str = "token ids") -> None:
        if any(t >= self.vocab_size for t in ids):
            raise APIError(400, f"{what} must be in [0, {self.vocab_size})", param=param)

    def sampling_params(self, req: p.CompletionRequest | p.ChatCompletionRequest
                        ) -> SamplingParams:
        self.check_token_ids(req.stop_token_ids or [], "stop_token_ids", "stop_token_ids")
        for s in [req.stop] if isinstance(req.stop, str) else req.stop or []:
            check_text(s, "stop")
        try:
            params = req.to_sampling_params()
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None
        return with_constraints(req, params)

    def render_chat(self, messages: list[p.ChatMessage], add_generation_prompt: bool,
                    tools: ToolPlan | None = None) -> list[int]:
        conversation = tool_conversation(messages, tools, self.template_knows_tools)
        for i, m in enumerate(conversation):
            check_text(m["content"], f"messages.{i}.content")
        template_tools = tools.tools if tools and self.template_knows_tools else None
        try:
            text = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt,
                tools=template_tools)
        except Exception as e:  # noqa: BLE001 - jinja2 TemplateError/SecurityError, no template
            raise APIError(400, f"cannot apply the chat template: {str(e)[:300]}",
                           param="messages") from None
        # the template holds the special tokens already
        return self.tokenizer.encode(text, add_special_tokens=False)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def completion_prompt(self, req: p.CompletionRequest) -> str | list[int]:
        prompt: Any = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > 1:
                raise APIError(400, "batched prompts are not supported; send one prompt "
                               "per request", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
        else:
            self.check_token_ids(prompt, "prompt", "prompt token ids")
        if not prompt:
            raise APIError(400, "the prompt is empty", param="prompt")
        return prompt

    # ---- the engine ----------------------------------------------------------------

    def progress(self, n: int, object_name: str) -> Progress:
        return Progress(n, self.metrics, object_name)

    async def submit(self, request_id: str, prompt: str | list[int],
                     params: SamplingParams) -> RequestStream:
        await check_compiles(self.grammars, params.structured_outputs)
        try:
            return await self.engine.add_request(request_id, prompt, params)
        except QueueFullError as e:
            raise APIError(503, str(e), "service_unavailable_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except EngineUnavailableError as e:
            raise APIError(503, str(e), "service_unavailable_error",
                           code="unavailable") from None
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    async def collect(self, request: Request, stream: RequestStream,
                      progress: Progress) -> RequestOutput:
        """Run a non-streamed request to the end; abort it if the client leaves."""
        watcher = asyncio.create_task(self._abort_on_disconnect(request, stream.request_id))
        final = None
        try:
            async for out in stream:
                progress.observe(out)
                final = out
        except EngineStepError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            watcher.cancel()
            progress.end(stream, self.engine)
        if final is None or not final.finished:
            raise APIError(503, "the request was aborted before it finished (server "
                           "shutting down)", "service_unavailable_error", code="aborted")
        return final

    async def _abort_on_disconnect(self, request: Request, request_id: str) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.engine.abort(request_id)
                return

    @staticmethod
    def usage(out: RequestOutput) -> p.UsageInfo:
        prompt_tokens = len(out.prompt_token_ids)
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens)


def get_serving(request: Request) -> Serving:
    """The FastAPI dependency routes use to reach the app's one `Serving`."""
    return request.app.state.serving


ServingDep = Annotated[Serving, Depends(get_serving)]
