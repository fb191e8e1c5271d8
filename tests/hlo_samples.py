"""A small HLO module in the TPU compiler's text format, for the HLO statistics tests: a 12-trip `while`
whose body all-reduces f32[8] and all-gathers f32[16] (async pair), one all-to-all of bf16[2, 4] and
one SparseCore offload outside the loop."""

SYNTHETIC_HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ar = f32[8]{0:T(128)} all-reduce(%x), replica_groups={}, to_apply=%sum
  %ags = (f32[4]{0}, f32[16]{0}) all-gather-start(%x), dimensions={0}
  %agd = f32[16]{0} all-gather-done(%ags)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %ar)
}

%cond (p.1: (s32[], f32[8])) -> pred[] {
  %p.1 = (s32[], f32[8]{0}) parameter(0)
  %limit = s32[]{:T(128)} constant(12), metadata={op_name="x"}
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  ROOT %lt = pred[] compare(%i.1, %limit), direction=LT
}

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}

ENTRY %main (x.0: f32[8]) -> f32[8] {
  %x.0 = f32[8]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[8]{0}) tuple(%zero, %x.0)
  %loop = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  %a2a = bf16[2,4]{1,0} all-to-all(%x.0), dimensions={0}
  %sc = ((s32[16]), s32[16], u32[]) call-start(%x.0), async_execution_thread="sparsecore", to_apply=%sum
  ROOT %out = f32[8]{0} get-tuple-element(%loop), index=1
}
"""
