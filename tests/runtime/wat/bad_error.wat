;; score returns 7 with error_ptr = {{ptr}} and error_len = {{len}}. Bytes at 16 are
;; invalid UTF-8 and terminal escape codes.
(module
  ;; @include _abi.wat
  (data (i32.const 16) "\ff\febad\1b[31mred\00end")
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param i32 i32 i32) (result i32)
    (global.set $err_ptr (i32.const {{ptr}}))
    (global.set $err_len (i32.const {{len}}))
    (i32.const 7))
)
