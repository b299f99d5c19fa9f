;; init refuses any params with "unknown param 'foo'".
(module
  ;; @include _abi.wat
  (data (i32.const 16) "unknown param 'foo'")
  (func (export "init") (param i32 i32) (result i32)
    (call $fail (i32.const 16) (i32.const 19)))
  (func (export "score") (param i32 i32 i32) (result i32) (i32.const 0))
)
