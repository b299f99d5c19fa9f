;; score writes {{value}} for each of the n candidates, plus {{extra}} more (negative:
;; fewer). Used for NaN, inf, out-of-range values and wrong counts.
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (call $fill (local.get $out)
                (i32.add (call $candidates (local.get $in)) (i32.const {{extra}}))
                (f64.const {{value}}))
    (i32.const 0))
)
