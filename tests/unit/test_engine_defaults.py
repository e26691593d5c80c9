"""The batch a user gets without flags: vLLM's CPU defaults (256 sequences a step
offline, 128 for a server), 2048 tokens a step offline and 256 for a server, one
source for the CLI and the LLM class."""

from tokenmill.cli import build_parser
from tokenmill.cli.engine_args import engine_config_from_args
from tokenmill.config import EngineConfig


def config_for(argv: list[str]) -> EngineConfig:
    return engine_config_from_args(build_parser(argv).parse_args(argv))


def test_serve_runs_up_to_128_sequences_a_step():
    assert config_for(["serve"]).max_num_seqs == 128
    assert config_for(["serve", "--max-num-seqs", "8"]).max_num_seqs == 8


def test_offline_commands_and_the_llm_class_run_up_to_256():
    assert EngineConfig().max_num_seqs == 256
    assert config_for(["generate", "hi"]).max_num_seqs == 256
    assert config_for(["bench", "--offline", "smollm2-135m"]).max_num_seqs == 256


def test_a_server_prefills_in_smaller_steps_than_offline_commands():
    assert config_for(["serve"]).max_num_batched_tokens == 256
    assert config_for(["serve", "--max-num-batched-tokens", "2048"]).max_num_batched_tokens \
        == 2048
    assert EngineConfig().max_num_batched_tokens == 2048
    assert config_for(["generate", "hi"]).max_num_batched_tokens == 2048
    assert config_for(["bench", "--offline", "smollm2-135m"]).max_num_batched_tokens == 2048
