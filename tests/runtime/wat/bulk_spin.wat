;; score fills 4 MiB of memory with one memory.fill, for ever: a few units of fuel per
;; round but milliseconds of work, so only the wall-clock backstop (epoch) stops it.
(module
  ;; @include _abi.wat
  (func (export "init") (param i32 i32) (result i32) (i32.const 0))
  (func (export "score") (param i32 i32 i32) (result i32)
    (drop (memory.grow (i32.const 64)))
    (loop $forever
      (memory.fill (i32.const 65536) (i32.const 7) (i32.const 4194304))
      (br $forever))
    (i32.const 0))
)
