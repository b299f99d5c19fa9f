;; A filter: keeps the candidates at even positions (0, 2, 4…), drops the others.
(module
  ;; @include _abi.wat
  ;; @include _msgpack.wat
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "filter") (param $in i32) (param $len i32) (param $out i32) (result i32)
    (local $n i32) (local $i i32)
    (local.set $n (call $candidates (local.get $in)))
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $n)))
        (i32.store8 (i32.add (local.get $out) (local.get $i))
                    (i32.eqz (i32.and (local.get $i) (i32.const 1))))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (i32.const 0))
)
