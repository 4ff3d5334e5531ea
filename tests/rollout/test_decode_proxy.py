"""``bench/proxies/decode.py`` keeps the decode step's kernel count down (issue: the GPU's decode step is bound
by its kernel count): at most 400 kernels a compiled step at Qwen2-0.5B's 24 layers (1,068 aten kernel ops
before the step was compiled, the mask built once a step and RoPE rid of its concatenation), one graph, and the
uncompiled step (the CPU default) at most 850 at 64 and 256 rows.

One inductor compilation of the 24-layer step: about a minute of CPU."""

from proxy_loader import load_proxy


def test_launches_counts_kernels_and_extern_calls_only():
    code = '''
def other():
    cpp_fused_not_in_call_0(buf0)

class Runner:
    def call(self, args):
        buf0 = empty_strided_cpu((1, 64, 1), (64, 1, 64), torch.float32)
        cpp_fused_add_mean_0(arg1_1, buf0)
        extern_kernels.mm(reinterpret_tensor(buf1, (64, 56), (56, 1), 0), arg8_1, out=buf2)
        buf9 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(buf3, arg4_1, arg10_1)
        triton_poi_fused_add_1.run(buf4, arg2_1, 4096, stream=stream0)
        del buf9
        buf10 = buf9[0]
        return (buf2, )
'''
    assert load_proxy("decode").launches(code) == 4


def test_decode_step_kernels_within_the_bound():
    result = load_proxy("decode").measure()
    assert result["decode.compiled_graphs"] == 1
    assert 24 * 4 < result["decode.kernels_per_step"] <= 400  # at least the 4 matmuls of each layer
    assert result["decode.eager_kernels_per_step"] <= 850
    assert result["decode.rows64.eager_kernels_per_step"] <= 850
