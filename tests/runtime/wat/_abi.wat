  ;; Shared by the test modules (spliced in by tests/runtime/wat.py): memory, a bump
  ;; allocator, the error message globals, and the ABI version.
  ;; Layout: bytes [0, 4096) hold each module's data segments; alloc hands out the rest.
  (memory (export "memory") 2)
  (global $bump (mut i32) (i32.const 4096))
  (global $err_ptr (mut i32) (i32.const 0))
  (global $err_len (mut i32) (i32.const 0))
  (global $out_ptr (mut i32) (i32.const 0))
  (global $out_len (mut i32) (i32.const 0))

  (func (export "epick_abi_version") (result i32) (i32.const 1))
  (func (export "error_ptr") (result i32) (global.get $err_ptr))
  (func (export "error_len") (result i32) (global.get $err_len))

  ;; alloc(n): bump-allocate, growing memory as needed; 0 when memory cannot grow.
  (func $alloc (export "alloc") (param $n i32) (result i32)
    (local $p i32) (local $end i32) (local $have i32)
    (local.set $p (global.get $bump))
    (local.set $end (i32.and (i32.add (i32.add (local.get $p) (local.get $n)) (i32.const 7))
                             (i32.const -8)))
    (local.set $have (i32.mul (memory.size) (i32.const 65536)))
    (if (i32.gt_u (local.get $end) (local.get $have))
      (then
        (if (i32.eq (memory.grow (i32.shr_u (i32.add (i32.sub (local.get $end) (local.get $have))
                                                     (i32.const 65535))
                                            (i32.const 16)))
                    (i32.const -1))
          (then (return (i32.const 0))))))
    (global.set $bump (local.get $end))
    (local.get $p))

  ;; fail(ptr, len): remember the error message, return status 1.
  (func $fail (param $ptr i32) (param $len i32) (result i32)
    (global.set $err_ptr (local.get $ptr))
    (global.set $err_len (local.get $len))
    (i32.const 1))
