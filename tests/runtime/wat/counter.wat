;; A well-behaved scorer with state. count = pre_request calls since init; every score is
;; count / 1000. State (export_state/import_state) is 8 bytes: count, snapshots (the
;; number of set_snapshot calls), both little-endian i32.
;; To let tests crash it on demand, pre_request traps (unreachable) when its input is
;; longer than 4000 bytes (tests send a long prompt).
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (global $count (mut i32) (i32.const 0))
  (global $snapshots (mut i32) (i32.const 0))
  (data (i32.const 16) "bad state length")
  (data (i32.const 64) "\81\a4name\a7counter")

  (func (export "init") (param i32 i32) (result i32)
    (global.set $count (i32.const 0))
    (global.set $snapshots (i32.const 0))
    (i32.const 0))
  (func (export "score") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (call $fill (local.get $out) (call $candidates (local.get $in))
                (f64.div (f64.convert_i32_u (global.get $count)) (f64.const 1000)))
    (i32.const 0))
  (func (export "set_snapshot") (param i32 i32) (result i32)
    (global.set $snapshots (i32.add (global.get $snapshots) (i32.const 1)))
    (i32.const 0))
  (func (export "pre_request") (param $p i32) (param $len i32) (result i32)
    (if (i32.gt_u (local.get $len) (i32.const 4000)) (then unreachable))
    (global.set $count (i32.add (global.get $count) (i32.const 1)))
    (i32.const 0))
  (func (export "post_response") (param i32 i32) (result i32) (i32.const 0))
  (func (export "describe") (result i32)
    (global.set $out_ptr (i32.const 64))
    (global.set $out_len (i32.const 14))
    (i32.const 0))
  (func (export "export_state") (result i32)
    (i32.store (i32.const 32) (global.get $count))
    (i32.store (i32.const 36) (global.get $snapshots))
    (global.set $out_ptr (i32.const 32))
    (global.set $out_len (i32.const 8))
    (i32.const 0))
  (func (export "import_state") (param $p i32) (param $len i32) (result i32)
    (if (i32.ne (local.get $len) (i32.const 8))
      (then
        (global.set $count (i32.const 0))
        (global.set $snapshots (i32.const 0))
        (return (call $fail (i32.const 16) (i32.const 16)))))
    (global.set $count (i32.load (local.get $p)))
    (global.set $snapshots (i32.load offset=4 (local.get $p)))
    (i32.const 0))
  (func (export "output_ptr") (result i32) (global.get $out_ptr))
  (func (export "output_len") (result i32) (global.get $out_len))
)
