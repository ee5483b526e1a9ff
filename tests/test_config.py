"""ServerArgs: the flags generated from it, the configs derived from it, validate()."""

from __future__ import annotations

import dataclasses

import pytest
from absl import flags

from runtime.arg_flags import ALIASES, args_from_flags, define_flags
from runtime.config import CacheConfig, SchedulerConfig
from runtime.server_args import Platform, ServerArgs


def _parse(*argv: str) -> ServerArgs:
    fv = flags.FlagValues()
    define_flags(fv)
    fv(["serve.py", *argv])
    return args_from_flags(fv)


def test_every_field_is_a_flag_with_its_default_and_help():
    fv = flags.FlagValues()
    define_flags(fv)
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    assert set(fv) == set(fields) | set(ALIASES)
    for name, f in fields.items():
        assert f.metadata["help"] and fv[name].help.endswith(f.metadata["help"]), name
        default = fv[name].default
        assert default == (list(map(str, f.default)) if isinstance(f.default, tuple)
                           else f.default), name
    assert fv["dtype"].parser.enum_values == ["float32", "bfloat16"]
    assert _parse() == ServerArgs()


def test_model_path_is_sglangs_spelling_of_model():
    assert _parse("--model_path=/ckpt").model == "/ckpt"


def test_flag_values_become_field_values():
    args = _parse("--chunked_prefill_size=0", "--trace_dir=", "--compilation_cache_dir=",
                  "--kv_len_buckets=256,1024", "--dtype=bfloat16", "--noenable_mixed_chunk",
                  "--per_layer_weights", "--mem_fraction=0.5", "--served_model_name=m",
                  "--api_key=")
    assert args.chunked_prefill_size is None  # <= 0: chunking off
    assert args.trace_dir is None and args.compilation_cache_dir is None and args.api_key is None
    assert args.kv_len_buckets == (256, 1024)
    assert (args.dtype, args.per_layer_weights, args.mem_fraction) == ("bfloat16", True, 0.5)
    assert args.served_model_name == "m"
    with pytest.raises(flags.IllegalFlagValueError):
        _parse("--attention_backend=cuda")
    with pytest.raises(ValueError, match="--decode_buckets=1,x: expected comma-separated "
                                         "integers"):
        _parse("--decode_buckets=1,x")


@pytest.mark.parametrize(("kw", "message"), [
    (dict(compress_weights=True), "--compress_weights stores bfloat16 weights: pass "
                                  "--dtype=bfloat16"),
    (dict(dtype="bfloat16", compress_weights=True, quantization="int8"),
     "--compress_weights runs on the packed CPU matmul without --quantization"),
    (dict(quantization="int8", cpu_matmul="xla"), "--quantization=int8 runs on the packed "
                                                  "CPU matmul: drop --cpu_matmul=xla"),
    (dict(page_size=16, kv_len_buckets=(100, 256)), r"--kv_len_buckets=100,256 must be "
                                                    "multiples of --page_size=16"),
    (dict(num_scheduler_steps=4, enable_multiplexing=True),
     "--num_scheduler_steps=4 runs in the plain step loop, not with --enable_split_prefill "
     "/ --enable_multiplexing"),
    (dict(dp=3, max_running_requests=8), "--dp=3 must divide --max_running_requests=8"),
    (dict(dp=2, enable_split_prefill=True, multiplex_fused=True),
     "--dp=2 .data-parallel attention. does not run with --enable_split_prefill, "
     "--multiplex_fused yet"),
    (dict(tp=2, attention_backend="cpu"), "--attention_backend=cpu: the CPU kernels are "
                                          "single-device.*use --attention_backend=xla"),
    (dict(enable_two_batch_overlap=True, per_layer_weights=True),
     "--enable_two_batch_overlap runs the stacked layer weights: drop --per_layer_weights"),
    (dict(enable_two_batch_overlap=True, tp=2, ep=2), "without tp: drop --tp=2"),
    (dict(fuse_projections=True, tp=3), "--fuse_projections with --tp=3: a column shard"),
    (dict(nnodes=2), "--nnodes=2 needs --dist_init_addr=HOST:PORT"),
    (dict(nnodes=2, node_rank=2, dist_init_addr="h:1"),
     r"--node_rank=2 must be in \[0, nnodes=2\)"),
    (dict(max_running_requests=0), "--max_running_requests=0: must be >= 1"),
    (dict(mem_fraction=1.5), r"--mem_fraction=1.5: must be in \(0, 1\]"),
    (dict(schedule_policy="random"), "--schedule_policy=random: expected one of fcfs, lpm"),
    (dict(decode_buckets=(4, 2)), "--decode_buckets=4,2: need increasing integers"),
])
def test_validate_names_the_flags_and_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kw)


def test_validate_reports_every_problem_at_once():
    with pytest.raises(ValueError) as e:
        ServerArgs(dp=3, max_running_requests=8, compress_weights=True)
    assert "--dp=3 must divide" in str(e.value) and "--compress_weights" in str(e.value)


def test_platform_rules_take_the_machine_as_facts():
    cpu = Platform(on_gpu=False)
    ServerArgs(cpu_matmul="packed", attention_backend="cpu").validate(cpu)
    no_avx = Platform(on_gpu=False, cpu_kernels_unavailable="needs AVX2 and FMA")
    with pytest.raises(ValueError, match="--cpu_matmul='packed' needs the CPU kernels: needs "
                                         "AVX2 and FMA"):
        ServerArgs(cpu_matmul="packed").validate(no_avx)
    ServerArgs().validate(no_avx)  # the defaults fall back to XLA instead
    with pytest.raises(ValueError, match="--attention_backend='cpu' needs the CPU kernels: "
                                         "the backend is a GPU"):
        ServerArgs(attention_backend="cpu").validate(Platform(on_gpu=True))
    x12 = ServerArgs(dtype="bfloat16", compress_weights=True)
    x12.validate(cpu)
    with pytest.raises(ValueError, match="--compress_weights: lacks AVX-512BW"):
        x12.validate(Platform(on_gpu=False, x12_unavailable="lacks AVX-512BW"))


def test_the_scheduler_config_comes_from_server_args():
    args = ServerArgs()
    default = SchedulerConfig()
    for name in ("max_running_requests", "max_prefill_tokens", "chunked_prefill_size",
                 "max_extend_seqs", "enable_mixed_chunk", "schedule_policy",
                 "disable_prefix_cache", "num_scheduler_steps"):
        assert getattr(default, name) == getattr(args, name), name
    assert default.overlap == (not args.disable_overlap_schedule)
    assert default.cache.page_size == args.page_size
    args = ServerArgs(max_running_requests=8, dp=2, chunked_prefill_size=None,
                      schedule_policy="lpm", disable_overlap_schedule=True)
    cfg = SchedulerConfig.from_server_args(args, CacheConfig(num_pages=9), 512, dp=2)
    assert (cfg.max_running_requests, cfg.chunk_size, cfg.schedule_policy, cfg.overlap,
            cfg.max_context_len) == (4, None, "lpm", False, 512)
