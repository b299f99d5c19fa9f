;; The smallest valid policy, spelled out (no shared snippets) so tests can break one
;; piece at a time: {{abi_version}}, {{score}} (the score export, or empty), {{extra}}
;; (more fields).
(module
  (memory (export "memory") 1)
  (func (export "epick_abi_version") (result i32) (i32.const {{abi_version}}))
  (func (export "alloc") (param i32) (result i32) (i32.const 1024))
  (func (export "error_ptr") (result i32) (i32.const 0))
  (func (export "error_len") (result i32) (i32.const 0))
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  {{score}}
  {{extra}}
)
