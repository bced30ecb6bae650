/* Shared by the AMX kernels beside it (prefill attention, linear, paged decode attention): asking
 * Linux for the tile state, and the one tile configuration they all use. Include only where
 * __AMX_TILE__ is defined. */
#ifndef LLMCTL_CPU_AMX_H
#define LLMCTL_CPU_AMX_H
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands AMX state to a process only once asked; 1 when granted. */
static inline int amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Tiles 0-7, each 16 rows of 64 bytes (per thread, before its first tile instruction). */
static inline void configure_tiles(void) {
    tile_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
}
#endif
