//! The launch sizes the DFlash training attention's scalar kernels (`attn_dflash.rs`) and its
//! tensor-core kernels (`attn_dflash_tc.rs`) share; its own module so that neither of the two
//! imports the other back.

use candle_core::{bail, DType, Result, Tensor};

/// Sizes of one launch; `cs` / `bs` are the head strides (in rows) of the context and block
/// key/value rows.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub h: usize,
    pub kv: usize,
    pub r: usize,
    pub c: usize,
    pub d: usize,
    pub block: usize,
    pub window: usize,
    pub cs: usize,
    pub bs: usize,
}

impl Dims {
    pub(super) fn check(&self, blocks: &Tensor) -> Result<()> {
        let Dims {
            h, kv, r, block, ..
        } = *self;
        if kv == 0 || h % kv != 0 {
            bail!("dflash attention: {h} heads over {kv} kv heads")
        }
        if block == 0 || block > 32 || r % block != 0 {
            bail!("dflash attention: block size {block} (1..=32) must divide {r} rows")
        }
        let nblocks = r / block;
        if blocks.dtype() != DType::U32
            || blocks.dims2()? != (nblocks, 2)
            || !blocks.is_contiguous()
        {
            bail!("dflash attention: blocks must be u32 [{nblocks}, 2]")
        }
        Ok(())
    }

    pub(super) fn ints(&self) -> [i32; 8] {
        [
            self.h as i32,
            self.kv as i32,
            self.r as i32,
            self.c as i32,
            self.cs as i32,
            self.bs as i32,
            self.block as i32,
            self.window as i32,
        ]
    }

    pub(super) fn scale(&self) -> f32 {
        1.0 / (self.d as f32).sqrt()
    }
}
