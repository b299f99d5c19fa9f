;; A resident-snapshot scorer whose set_snapshot always refuses ("snapshot refused");
;; score writes 0.5 everywhere.
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (data (i32.const 16) "snapshot refused")
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "set_snapshot") (param i32 i32) (result i32)
    (call $fail (i32.const 16) (i32.const 16)))
  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (call $fill (local.get $out) (call $candidates (local.get $in)) (f64.const 0.5))
    (i32.const 0))
)
