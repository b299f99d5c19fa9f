;; score fails (status 3, "odd candidate count") when the candidate count is odd, and
;; scores 0.25 everywhere otherwise.
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (data (i32.const 16) "odd candidate count")
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (local $n i32)
    (local.set $n (call $candidates (local.get $in)))
    (if (i32.and (local.get $n) (i32.const 1))
      (then
        (drop (call $fail (i32.const 16) (i32.const 19)))
        (return (i32.const 3))))
    (call $fill (local.get $out) (local.get $n) (f64.const 0.25))
    (i32.const 0))
)
