use super::*;

/// Deterministic values in [-1, 1).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// K and V pools of `num_blocks` blocks holding `keys` and `vals` (a token's slot after
/// another) at the slots `table` gives their positions.
fn pools(
    layout: BlockLayout,
    num_blocks: usize,
    table: &[BlockId],
    keys: &[f32],
    vals: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let mut k_pool = vec![0f32; num_blocks * layout.block_len()];
    let mut v_pool = k_pool.clone();
    let (bs, row) = (layout.block_size, layout.slot_len());
    for j in 0..keys.len() / row {
        let slot = table[j / bs] as usize * bs + j % bs;
        let span = j * row..(j + 1) * row;
        layout.store(
            &mut k_pool,
            &mut v_pool,
            slot,
            &keys[span.clone()],
            &vals[span],
        );
    }
    (k_pool, v_pool)
}

/// Every compiled path of the kernel, on every shape class (block sizes that are and
/// are not multiples of the vector width, head sizes with and without a remainder mod
/// 4 and mod the registers' dimensions, groups of 1 to 4 heads), against softmax
/// attention in f64 over the same keys read contiguously: outputs and weights.
#[test]
fn attend_group_matches_f64_attention_on_every_kernel_and_shape() {
    for cpu in CpuKernel::ALL.into_iter().filter(|k| k.is_available()) {
        for (bs, d, kv_heads, group, pos) in [
            (16usize, 64usize, 3usize, 3usize, 40usize),
            (16, 16, 2, 2, 0),
            (7, 6, 2, 4, 20),
            (8, 72, 1, 1, 9),
            (1, 5, 1, 2, 3),
        ] {
            let num_blocks = 2 * (pos + 1).div_ceil(bs) + 1;
            let layout = BlockLayout {
                block_size: bs,
                kv_heads,
                head_dim: d,
            };
            // The sequence uses every other block, from the end.
            let table: Vec<BlockId> = (0..(pos + 1).div_ceil(bs))
                .map(|b| (num_blocks - 1 - 2 * b) as BlockId)
                .collect();
            let row = layout.slot_len();
            let (keys, vals) = (values((pos + 1) * row, 1), values((pos + 1) * row, 2));
            let (k_pool, v_pool) = pools(layout, num_blocks, &table, &keys, &vals);
            let kernel = BlockAttention::new(&k_pool, &v_pool, layout);
            for kv_head in 0..kv_heads {
                let q = values(group * d, 3 + kv_head as u64);
                let mut out = vec![f32::NAN; group * d];
                let mut probs = vec![f32::NAN; group * (pos + 1)];
                kernel.attend_group(cpu, &q, kv_head, pos, &table, &mut out, Some(&mut probs));
                let mut alone = vec![f32::NAN; group * d];
                kernel.attend_group(cpu, &q, kv_head, pos, &table, &mut alone, None);
                assert_eq!(out, alone, "the weights' output changes nothing");
                for h in 0..group {
                    let q_h = &q[h * d..(h + 1) * d];
                    let at = |x: &[f32], j: usize, i: usize| x[j * row + kv_head * d + i] as f64;
                    let s: Vec<f64> = (0..=pos)
                        .map(|j| {
                            let dot: f64 = (0..d).map(|i| q_h[i] as f64 * at(&keys, j, i)).sum();
                            dot / (d as f64).sqrt()
                        })
                        .collect();
                    let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                    for j in 0..=pos {
                        let (got, want) = (probs[h * (pos + 1) + j] as f64, (s[j] - max).exp() / z);
                        assert!((got - want).abs() < 1e-6, "{cpu}: weight {h},{j}");
                    }
                    for i in 0..d {
                        let want: f64 = (0..=pos)
                            .map(|j| (s[j] - max).exp() / z * at(&vals, j, i))
                            .sum();
                        let got = out[h * d + i] as f64;
                        assert!(
                            (got - want).abs() < 1e-5,
                            "{cpu}, bs {bs}, d {d}, group {group}, head {h}, dim {i}: \
                             {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The block size and the blocks' places change no bit of the result.
#[test]
fn results_do_not_depend_on_the_block_layout() {
    let cpu = crate::cpu_kernel().unwrap();
    let (kv_heads, d, group, len) = (2usize, 24usize, 3usize, 37usize);
    let row = kv_heads * d;
    let (keys, vals) = (values(len * row, 7), values(len * row, 8));
    let q = values(group * d, 9);
    let run = |bs: usize, spread: usize| {
        let layout = BlockLayout {
            block_size: bs,
            kv_heads,
            head_dim: d,
        };
        let blocks = len.div_ceil(bs);
        let table: Vec<BlockId> = (0..blocks).map(|b| (b * spread) as BlockId).collect();
        let (k_pool, v_pool) = pools(layout, blocks * spread, &table, &keys, &vals);
        let kernel = BlockAttention::new(&k_pool, &v_pool, layout);
        let mut out = vec![0f32; group * d];
        let mut probs = vec![0f32; group * len];
        kernel.attend_group(cpu, &q, 1, len - 1, &table, &mut out, Some(&mut probs));
        let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        (bits(&out), bits(&probs))
    };
    let want = run(16, 1);
    for (bs, spread) in [(1, 1), (4, 3), (5, 2), (16, 2), (64, 1)] {
        assert_eq!(run(bs, spread), want, "block size {bs}, spread {spread}");
    }
}
