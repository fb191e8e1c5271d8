# ruff: noqa: E501  (HLO instructions are one line each, as the compiler writes them)
"""Small HLO modules in the TPU compiler's text format for the HBM walk's tests (tests/test_hbm_walk.py).

CATEGORY_HLO: one top-level instruction per category of `walk_categories` (op names as JAX writes them).
OVERFLOW_HLO: a 3-trip `while` (known trip count) around a loop whose bound is data (the MoE overflow
passes' shape: the condition compares the counter with a loop-carried value, not a constant).
VMEM_HLO: a prefetch (copy-start / copy-done) of f32[128,256] into memory space S(1), read by a fusion.
GATHER_SCATTER_HLO: a gather of 10 rows of an f32[1000,64] table, a scatter-add of 10 rows into it,
a fusion whose root scatters into its parameter in place, and one whose root is such a fusion (TPU's
scatter_custom_fusion).
"""

_SUM = """%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}
"""

CATEGORY_HLO = "HloModule m, is_scheduled=true\n\n" + _SUM + """
%fused_stack (p0: f32[4,64,128], p1: f32[64,128], p2: s32[]) -> f32[4,64,128] {
  %p0 = f32[4,64,128]{2,1,0} parameter(0)
  %p1 = f32[64,128]{1,0} parameter(1)
  %row = f32[1,64,128]{2,1,0} bitcast(%p1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %dus = f32[4,64,128]{2,1,0} dynamic-update-slice(%p0, %row, %p2, %z, %z)
}

%fused_slice (r0: f32[4,64,128], r1: s32[]) -> f32[64,128] {
  %r0 = f32[4,64,128]{2,1,0} parameter(0)
  %r1 = s32[] parameter(1)
  %zr = s32[] constant(0)
  %ds = f32[1,64,128]{2,1,0} dynamic-slice(%r0, %r1, %zr, %zr), dynamic_slice_sizes={1,64,128}
  ROOT %sq = f32[64,128]{1,0} bitcast(%ds)
}

%fused_dot_into_stack (k0: f32[4,64,128], k1: bf16[64,128], k2: bf16[128,128], k3: s32[]) -> f32[4,64,128] {
  %k0 = f32[4,64,128]{2,1,0} parameter(0)
  %k1 = bf16[64,128]{1,0} parameter(1)
  %k2 = bf16[128,128]{1,0} parameter(2)
  %kd = f32[64,128]{1,0} dot(%k1, %k2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %kr = f32[1,64,128]{2,1,0} bitcast(%kd)
  %k3 = s32[] parameter(3)
  %kz = s32[] constant(0)
  ROOT %kdus = f32[4,64,128]{2,1,0} dynamic-update-slice(%k0, %kr, %k3, %kz, %kz)
}

%fused_dot (q0: bf16[64,128], q1: bf16[128,128]) -> f32[64,128] {
  %q0 = bf16[64,128]{1,0} parameter(0)
  %q1 = bf16[128,128]{1,0} parameter(1)
  ROOT %d = f32[64,128]{1,0} dot(%q0, %q1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_gather (g0: f32[256,128], g1: s32[64,1]) -> f32[64,128] {
  %g0 = f32[256,128]{1,0} parameter(0)
  %g1 = s32[64,1]{1,0} parameter(1)
  ROOT %g = f32[64,128]{1,0} gather(%g0, %g1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,128}
}

%fused_copy (c0: f32[64,128]) -> bf16[128,64] {
  %c0 = f32[64,128]{1,0} parameter(0)
  %t = f32[128,64]{1,0} transpose(%c0), dimensions={1,0}
  ROOT %cv = bf16[128,64]{1,0} convert(%t)
}

%fused_adam (m0: f32[64,128], m1: f32[64,128]) -> f32[64,128] {
  %m0 = f32[64,128]{1,0} parameter(0)
  %m1 = f32[64,128]{1,0} parameter(1)
  ROOT %m = f32[64,128]{1,0} multiply(%m0, %m1)
}

ENTRY %main (x: f32[64,128], w: bf16[128,128], stack: f32[4,64,128], i: s32[], idx: s32[64,1]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %w = bf16[128,128]{1,0} parameter(1)
  %stack = f32[4,64,128]{2,1,0} parameter(2)
  %i = s32[] parameter(3)
  %idx = s32[64,1]{1,0} parameter(4)
  %a2a = f32[64,128]{1,0} all-to-all(%x), dimensions={0}, metadata={op_name="jit(train_step)/jvp(moe)/experts/all_to_all"}
  %ag = f32[64,128]{1,0} all-gather(%x), dimensions={0}, metadata={op_name="jit(train_step)/all_gather"}
  %st = f32[4,64,128]{2,1,0} fusion(%stack, %x, %i), kind=kLoop, calls=%fused_stack, metadata={op_name="jit(train_step)/while/body/dynamic_update_slice"}
  %sl = f32[64,128]{1,0} fusion(%stack, %i), kind=kLoop, calls=%fused_slice, metadata={op_name="jit(train_step)/transpose(jvp())/while/body/squeeze"}
  %lm = f32[4,64,128]{2,1,0} fusion(%stack, %xb, %w, %i), kind=kOutput, calls=%fused_dot_into_stack, metadata={op_name="jit(train_step)/jvp(unembedding_loss)/dot_general"}
  %xb = bf16[64,128]{1,0} convert(%x), metadata={op_name="jit(train_step)/jvp(moe)/experts/convert_element_type"}
  %kern = f32[64,128]{1,0} custom-call(%xb, %w), custom_call_target="tpu_custom_call", metadata={op_name="jit(train_step)/jvp(moe)/experts/pallas_call"}
  %att = f32[64,128]{1,0} fusion(%xb, %w), kind=kOutput, calls=%fused_dot, metadata={op_name="jit(train_step)/transpose(jvp(attention))/dot_general"}
  %gat = f32[64,128]{1,0} fusion(%x, %idx), kind=kLoop, calls=%fused_gather, metadata={op_name="jit(train_step)/jvp(moe)/gather"}
  %cp = bf16[128,64]{1,0} fusion(%x), kind=kLoop, calls=%fused_copy, metadata={op_name="jit(train_step)/jvp(moe)/transpose"}
  %loss = f32[64,128]{1,0} exponential(%x), metadata={op_name="jit(train_step)/jvp(unembedding_loss)/exp"}
  %adam = f32[64,128]{1,0} fusion(%x, %att), kind=kLoop, calls=%fused_adam, metadata={op_name="jit(train_step)/optimizer/mul"}
  ROOT %norm = f32[64,128]{1,0} add(%x, %adam), metadata={op_name="jit(train_step)/jvp(norm)/add"}
}
"""

# category of each instruction above, by name (ENTRY's convert %xb is a copy in the experts scope)
CATEGORY_OF = {"a2a": "expert exchange", "ag": "other collectives", "st": "residual stacks", "xb": "copies",
               "sl": "residual stacks", "lm": "loss",
               "kern": "expert kernels", "att": "attention", "gat": "permutations / gathers / scatters",
               "cp": "copies", "loss": "loss", "adam": "optimizer", "norm": "other"}

OVERFLOW_HLO = """HloModule m, is_scheduled=true

%pass_body (pb: (s32[], s32[], f32[64,128])) -> (s32[], s32[], f32[64,128]) {
  %pb = (s32[], s32[], f32[64,128]{1,0}) parameter(0)
  %q = s32[] get-tuple-element(%pb), index=0
  %n = s32[] get-tuple-element(%pb), index=1
  %acc = f32[64,128]{1,0} get-tuple-element(%pb), index=2
  %grow = f32[64,128]{1,0} add(%acc, %acc), metadata={op_name="jit(train_step)/jvp(moe)/experts/while/body/add"}
  %one = s32[] constant(1)
  %q1 = s32[] add(%q, %one)
  ROOT %tb = (s32[], s32[], f32[64,128]{1,0}) tuple(%q1, %n, %grow)
}

%pass_cond (pc: (s32[], s32[], f32[64,128])) -> pred[] {
  %pc = (s32[], s32[], f32[64,128]{1,0}) parameter(0)
  %qc = s32[] get-tuple-element(%pc), index=0
  %nc = s32[] get-tuple-element(%pc), index=1
  ROOT %lt = pred[] compare(%qc, %nc), direction=LT
}

%layer_body (lb: (s32[], s32[], f32[64,128])) -> (s32[], s32[], f32[64,128]) {
  %lb = (s32[], s32[], f32[64,128]{1,0}) parameter(0)
  %h = f32[64,128]{1,0} get-tuple-element(%lb), index=2
  %act = f32[64,128]{1,0} tanh(%h), metadata={op_name="jit(train_step)/while/body/tanh"}
  %passes = (s32[], s32[], f32[64,128]{1,0}) while(%lb), condition=%pass_cond, body=%pass_body
  %out = f32[64,128]{1,0} get-tuple-element(%passes), index=2
  %l = s32[] get-tuple-element(%lb), index=0
  %k = s32[] get-tuple-element(%lb), index=1
  %one.1 = s32[] constant(1)
  %l1 = s32[] add(%l, %one.1)
  ROOT %tl = (s32[], s32[], f32[64,128]{1,0}) tuple(%l1, %k, %act)
}

%layer_cond (lc: (s32[], s32[], f32[64,128])) -> pred[] {
  %lc = (s32[], s32[], f32[64,128]{1,0}) parameter(0)
  %lcount = s32[] get-tuple-element(%lc), index=0
  %three = s32[] constant(3)
  ROOT %llt = pred[] compare(%lcount, %three), direction=LT
}

ENTRY %main (x: f32[64,128], n: s32[]) -> f32[64,128] {
  %x = f32[64,128]{1,0} parameter(0)
  %n0 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], s32[], f32[64,128]{1,0}) tuple(%zero, %n0, %x)
  %layers = (s32[], s32[], f32[64,128]{1,0}) while(%init), condition=%layer_cond, body=%layer_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %y = f32[64,128]{1,0} get-tuple-element(%layers), index=2
}
"""

VMEM_HLO = """HloModule m, is_scheduled=true

%fused_scale (v0: f32[128,256]) -> f32[128,256] {
  %v0 = f32[128,256]{1,0:T(8,128)S(1)} parameter(0)
  ROOT %s = f32[128,256]{1,0:T(8,128)} add(%v0, %v0)
}

ENTRY %main (x: f32[128,256]) -> f32[128,256] {
  %x = f32[128,256]{1,0:T(8,128)} parameter(0)
  %cs = (f32[128,256]{1,0:T(8,128)S(1)}, f32[128,256]{1,0:T(8,128)}, u32[]{:S(2)}) copy-start(%x)
  %cd = f32[128,256]{1,0:T(8,128)S(1)} copy-done(%cs)
  %tmp = f32[128,256]{1,0:T(8,128)S(1)} negate(%x)
  ROOT %y = f32[128,256]{1,0:T(8,128)} fusion(%cd), kind=kLoop, calls=%fused_scale
}
"""

GATHER_SCATTER_HLO = "HloModule m, is_scheduled=true\n\n" + _SUM + """
%fused_scatter (s0: f32[1000,64], s1: s32[10,1], s2: f32[10,64]) -> f32[1000,64] {
  %s0 = f32[1000,64]{1,0} parameter(0)
  %s1 = s32[10,1]{1,0} parameter(1)
  %s2 = f32[10,64]{1,0} parameter(2)
  %twice = f32[10,64]{1,0} add(%s2, %s2)
  ROOT %sc = f32[1000,64]{1,0} scatter(%s0, %s1, %twice), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%sum
}

%fused_nested (n0: f32[1000,64], n1: s32[10,1], n2: f32[10,64]) -> f32[1000,64] {
  %n0 = f32[1000,64]{1,0} parameter(0)
  %n1 = s32[10,1]{1,0} parameter(1)
  %n2 = f32[10,64]{1,0} parameter(2)
  %scaled = f32[10,64]{1,0} multiply(%n2, %n2)
  ROOT %inner = f32[1000,64]{1,0} fusion(%n0, %n1, %scaled), kind=kCustom, calls=%fused_scatter
}

ENTRY %main (table: f32[1000,64], idx: s32[10,1], upd: f32[10,64]) -> f32[1000,64] {
  %table = f32[1000,64]{1,0} parameter(0)
  %idx = s32[10,1]{1,0} parameter(1)
  %upd = f32[10,64]{1,0} parameter(2)
  %rows = f32[10,64]{1,0} gather(%table, %idx), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,64}
  %added = f32[1000,64]{1,0} scatter(%table, %idx, %rows), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%sum
  %fs = f32[1000,64]{1,0} fusion(%added, %idx, %upd), kind=kLoop, calls=%fused_scatter
  ROOT %nfs = f32[1000,64]{1,0} fusion(%fs, %idx, %upd), kind=kCustom, calls=%fused_nested
}
"""
