"""`tokenmill generate` and `tokenmill chat`: text from the engine in a terminal."""

from __future__ import annotations

import argparse
import sys

from tokenmill.cli.engine_args import add_engine_args, engine_config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text for one prompt")
    gen.add_argument("prompt")
    _add_sampling_args(gen, default_max_tokens=64)
    add_engine_args(gen, model_positional=False)
    gen.set_defaults(func=run_generate)

    chat = sub.add_parser("chat", help="an interactive chat that streams tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    _add_sampling_args(chat, default_max_tokens=512)
    add_engine_args(chat, model_positional=False)
    chat.set_defaults(func=run_chat)


def _add_sampling_args(p: argparse.ArgumentParser, default_max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=default_max_tokens)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--sampling-seed", type=int, default=None, dest="sampling_seed")
    g.add_argument("--stop", action="append", default=[])
    g.add_argument("--ignore-eos", action="store_true")


def _sampling_params(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                          stop=args.stop, ignore_eos=args.ignore_eos)


def _engine(args: argparse.Namespace):
    from tokenmill.engine.core.llm_engine import LLMEngine

    return LLMEngine(engine_config_from_args(args))


def _stream(engine, request_id: str, prompt, params, out=sys.stdout) -> str:
    """Run one request to completion, writing text as it is produced."""
    engine.add_request(request_id, prompt, params)
    shown = ""
    while engine.has_unfinished_requests():
        for res in engine.step():
            text = res.outputs[0].text
            out.write(text[len(shown):])
            out.flush()
            shown = text
    return shown


def run_generate(args: argparse.Namespace) -> int:
    try:
        params = _sampling_params(args)
        engine = _engine(args)
        _stream(engine, "generate-0", args.prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    return 0


def run_chat(args: argparse.Namespace) -> int:
    try:
        params = _sampling_params(args)
        engine = _engine(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print(f"tokenmill chat · {engine.model_name} · empty line or Ctrl-D to quit")
    turn = 0
    while True:
        try:
            user = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not user:
            return 0
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=True)
        ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
        try:
            reply = _stream(engine, f"chat-{turn}", ids, params)
        except ValueError as e:  # e.g. the conversation outgrew the context
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": reply})
        turn += 1
