// SPDX-License-Identifier: GPL-2.0
/*
 * epick's L4 load balancer: a cgroup/connect4 program (socket-level load balancing).
 *
 * A TCP connect() from a process in the attached cgroup to a virtual address (a key of
 * `vips`) is rewritten, before any packet exists, to a backend drawn from that virtual
 * address's slot table: SLOTS entries, each backend holding slots in proportion to its
 * epick weight (examples/ebpf/agent.py writes them from WatchWeights). One random slot
 * per connect(): new connections spread by the weights; an established connection never
 * moves. Every other connect() passes untouched.
 *
 * Each virtual address owns two tables (a double buffer): the agent fills the one not
 * in use, then flips `active` in one map update, so a connect() never sees half a table.
 * A table with no backend (slot address 0) refuses the connect() with EPERM: epick says
 * no endpoint is eligible, and a refusal is better than a connection to nowhere.
 *
 * Build: clang -O2 -g -target bpf -c lb.bpf.c -o lb.bpf.o   (make -C examples/ebpf)
 */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

#define SLOTS 1024      /* per table; a power of two (the draw is a mask) */
#define MAX_VIPS 64
#define PROTO_TCP 6

struct vip_key {        /* what connect() asked for, network byte order */
	__u32 addr;
	__u16 port;
	__u16 pad;
};

struct vip_state {
	__u32 index;        /* which tables: slots [(index*2 + active) * SLOTS, +SLOTS) */
	__u32 active;       /* 0 or 1 */
};

struct backend {        /* network byte order; addr 0 = empty slot */
	__u32 addr;
	__u16 port;
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_VIPS);
	__type(key, struct vip_key);
	__type(value, struct vip_state);
} vips SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_VIPS * 2 * SLOTS);
	__type(key, __u32);
	__type(value, struct backend);
} slots SEC(".maps");

/* Per virtual address: [index*2] connects sent to a backend, [index*2+1] refused. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_VIPS * 2);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

static __always_inline void count(__u32 key)
{
	__u64 *n = bpf_map_lookup_elem(&stats, &key);

	if (n)
		*n += 1;
}

SEC("cgroup/connect4")
int epick_connect4(struct bpf_sock_addr *ctx)
{
	struct vip_key key = {};
	struct vip_state *vip;
	struct backend *be;
	__u32 slot;

	if (ctx->protocol != PROTO_TCP)
		return 1;
	key.addr = ctx->user_ip4;
	key.port = (__u16)ctx->user_port;
	vip = bpf_map_lookup_elem(&vips, &key);
	if (!vip)
		return 1;
	slot = (vip->index * 2 + (vip->active & 1)) * SLOTS
	       + (bpf_get_prandom_u32() & (SLOTS - 1));
	be = bpf_map_lookup_elem(&slots, &slot);
	if (!be || !be->addr) {
		count(vip->index * 2 + 1);
		return 0;   /* connect() fails with EPERM */
	}
	ctx->user_ip4 = be->addr;
	ctx->user_port = be->port;
	count(vip->index * 2);
	return 1;
}

char LICENSE[] SEC("license") = "GPL";
