;; score grows memory 16 pages at a time, touching each new page, until memory.grow
;; fails; then it stores one byte past the end of memory (an out-of-bounds trap).
(module
  ;; @include _abi.wat
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param i32 i32 i32) (result i32)
    (loop $more
      (if (i32.eq (memory.grow (i32.const 16)) (i32.const -1))
        (then (i32.store8 (i32.mul (memory.size) (i32.const 65536)) (i32.const 1))))
      (i32.store8 (i32.sub (i32.mul (memory.size) (i32.const 65536)) (i32.const 1)) (i32.const 1))
      (br $more))
    (i32.const 0))
)
