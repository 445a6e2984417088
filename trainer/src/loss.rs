//! The clipped surrogate loss of the GRPO family over one packed buffer, with per-token
//! weights from pruning and normalisers computed once over the full, unpruned batch.

use candle_core::{DType, Device, Result, Tensor};
use dppo_model::behaviour::Shaping;
use dppo_model::lm_head::TokenStats;
use dppo_model::{CausalLm, PackedRow};
use serde::{Deserialize, Serialize};

use crate::correction::RolloutCorrection;
use crate::mismatch::{diffs, Mismatch};

/// How token losses are summed into the batch loss (`loss_agg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// DAPO: `1/N_tok * sum of token losses`. Under prompt pruning `N_tok` is itself
    /// estimated, so this mode is a ratio estimator (bias O(1/B)).
    TokenMean,
    /// GRPO: `1/N_seq * sum_seq 1/|o| * sum_t`.
    SeqMeanTokenMean,
    /// Dr. GRPO: `1/(N_seq * L_max) * sum_seq sum_t` (the default: a normaliser fixed
    /// before the pruning draw keeps the estimate exactly unbiased).
    SeqMeanTokenSumNorm,
}

/// Token-level ratios (PPO/GRPO) or sequence-level ratios (GSPO).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RatioLevel {
    Token,
    Sequence,
}

/// Loss hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossConfig {
    pub eps_low: f64,
    pub eps_high: f64,
    pub loss_agg: LossAgg,
    pub ratio_level: RatioLevel,
    /// Weight of the k3 KL penalty against the reference policy (0: none, no reference).
    pub beta: f64,
    /// The rollout's sampling temperature: the learner's logprobs are those of
    /// `softmax(logits / temperature)`, the distribution the engine sampled from.
    #[serde(default = "unit_temperature")]
    pub temperature: f64,
    /// The rollout's top-p: the learner's logprobs are renormalised over the same nucleus.
    #[serde(default = "unit_top_p")]
    pub top_p: f64,
    /// The ratio's denominator: the learner's own logprobs before the update (verl's
    /// recomputed `old_log_prob`) instead of the rollout's.
    #[serde(default)]
    pub recompute_old_logprobs: bool,
    /// Importance weights and masks from the learner-rollout ratio.
    #[serde(default)]
    pub correction: RolloutCorrection,
}

fn unit_temperature() -> f64 {
    1.0
}

fn unit_top_p() -> f64 {
    1.0
}

/// The full-batch denominators, computed before packing (never from a buffer).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalisers {
    /// All completions of all drawn prompts.
    pub num_seqs: f64,
    /// `sum over rolled-out prompts j of w_q(j) * T_j`.
    pub num_tokens: f64,
    /// `max_response_len` (Dr. GRPO's constant).
    pub max_len: f64,
}

/// One kept sequence, ready for the learner.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainSeq {
    /// Prompt then completion tokens.
    pub tokens: Vec<u32>,
    pub num_prompt_tokens: usize,
    pub advantage: f64,
    /// Pruning weight `w_q * w_o` (1 when unpruned).
    pub weight: f64,
    /// Rollout-policy logprob of each completion token.
    pub rollout_logprobs: Vec<f32>,
}

impl TrainSeq {
    /// Completion tokens (those that carry a loss).
    pub fn num_completion_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }
}

/// A buffer's loss and its metric sums.
#[derive(Debug, Clone)]
pub struct BufferLoss {
    /// Scalar; its gradient is this buffer's share of the batch gradient.
    pub loss: Tensor,
    /// Sums over this buffer's completion tokens (for metrics).
    pub num_tokens: usize,
    pub num_clipped: usize,
    pub entropy_sum: f64,
    /// The learner's logprobs against the rollout's.
    pub mismatch: Mismatch,
}

/// Forward of one packed buffer through `model` (and through the frozen `reference`
/// model when the KL term is on) and its loss.
pub fn buffer_loss(
    model: &CausalLm,
    reference: Option<&CausalLm>,
    seqs: &[&TrainSeq],
    cfg: &LossConfig,
    norm: &Normalisers,
) -> Result<BufferLoss> {
    let row = CompletionRows::new(seqs, model.device())?;
    let stats = row.token_stats(model, cfg.temperature, cfg.top_p)?;
    let ref_logprobs = match reference {
        Some(r) if cfg.beta > 0.0 => Some(
            row.token_stats(r, cfg.temperature, cfg.top_p)?
                .logprobs
                .detach(),
        ),
        _ => None,
    };
    let entropy_sum = stats
        .entropy
        .to_dtype(DType::F64)?
        .sum_all()?
        .to_scalar::<f64>()?;
    let mut out = token_loss(&stats.logprobs, ref_logprobs.as_ref(), seqs, cfg, norm)?;
    out.entropy_sum = entropy_sum;
    Ok(out)
}

/// Summed negative log-likelihood of the completion tokens of one packed buffer
/// (supervised warm-up on demonstrations).
pub fn buffer_nll(model: &CausalLm, seqs: &[&TrainSeq]) -> Result<Tensor> {
    let row = CompletionRows::new(seqs, model.device())?;
    row.token_stats(model, 1.0, 1.0)?.logprobs.sum_all()?.neg()
}

/// A packed row and the rows of it whose next token is a completion token.
struct CompletionRows {
    row: PackedRow,
    /// (M,) u32: positions `P-1 .. len-2` of each sequence.
    rows: Tensor,
    /// (M,) u32: the completion tokens they predict.
    targets: Tensor,
}

impl CompletionRows {
    fn new(seqs: &[&TrainSeq], device: &Device) -> Result<Self> {
        let tokens: Vec<&[u32]> = seqs.iter().map(|s| s.tokens.as_slice()).collect();
        let row = PackedRow::new(&tokens, device)?;
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        for (s, start) in seqs.iter().zip(&row.cu_seqlens) {
            for p in s.num_prompt_tokens..s.tokens.len() {
                rows.push((start + p - 1) as u32);
                targets.push(s.tokens[p]);
            }
        }
        let n = rows.len();
        Ok(Self {
            rows: Tensor::from_vec(rows, n, device)?,
            targets: Tensor::from_vec(targets, n, device)?,
            row,
        })
    }

    /// Logprobs of the targets and entropies (M,) under `model` at the completion rows, of
    /// `softmax(logits / temperature)` over the top-`top_p` nucleus (the engine's sampling
    /// distribution, in the sampler's arithmetic on the CPU); the lm-head runs on those
    /// rows only.
    fn token_stats(&self, model: &CausalLm, temperature: f64, top_p: f64) -> Result<TokenStats> {
        let r = &self.row;
        let hidden = model.forward(&r.input_ids, &r.positions, &mut r.attention())?;
        let rows = hidden.index_select(&self.rows, 0)?;
        // The config's values are f32 (the engine's), widened: narrowing is exact.
        let shaping = Shaping::nucleus(temperature as f32, top_p as f32);
        model.shaped_token_stats(&rows, &self.targets, shaping)
    }
}

/// The loss given the current policy's logprobs `logprobs` (M,) of the completion tokens
/// of `seqs`, in order, and the reference policy's (M,) when `beta > 0`. Separate from the
/// forward so it can be checked by hand.
pub fn token_loss(
    logprobs: &Tensor,
    reference: Option<&Tensor>,
    seqs: &[&TrainSeq],
    cfg: &LossConfig,
    norm: &Normalisers,
) -> Result<BufferLoss> {
    let device = logprobs.device();
    let dtype = logprobs.dtype();
    let per_token = |f: &dyn Fn(&TrainSeq, usize) -> f64| -> Result<Tensor> {
        let v: Vec<f64> = seqs
            .iter()
            .flat_map(|s| (0..s.num_completion_tokens()).map(move |t| f(s, t)))
            .collect();
        Tensor::new(v, device)?.to_dtype(dtype)
    };
    let rollout = per_token(&|s, t| s.rollout_logprobs[t] as f64)?;
    let d = diffs(logprobs, &rollout)?;
    let mut mismatch = Mismatch::from_diffs(&d);
    // One update per rollout: before it, the learner's logprobs are the old policy's.
    let old = if cfg.recompute_old_logprobs {
        logprobs.detach()
    } else {
        rollout
    };
    let adv = per_token(&|s, _| s.advantage)?;
    let coef =
        per_token(&|s, _| s.weight * agg_factor(cfg.loss_agg, norm, s.num_completion_tokens()))?;
    // 1. Ratios: per token, or GSPO's length-normalised sequence ratio shared by its tokens.
    let log_ratio = (logprobs - &old)?;
    let log_ratio = match cfg.ratio_level {
        RatioLevel::Token => log_ratio,
        RatioLevel::Sequence => sequence_mean(&log_ratio, seqs, device)?,
    };
    let ratio = log_ratio.exp()?;
    // 2. Clipped surrogate: l = -min(rho A, clip(rho, 1-eps_low, 1+eps_high) A).
    let (lo, hi) = (1.0 - cfg.eps_low, 1.0 + cfg.eps_high);
    let clipped = ratio.clamp(lo, hi)?;
    let surr1 = (&ratio * &adv)?;
    let surr2 = (&clipped * &adv)?;
    let use_unclipped = surr1.le(&surr2)?;
    let mut token_losses = use_unclipped.where_cond(&surr1, &surr2)?.neg()?;
    // 2b. Rollout correction: weights from the learner-rollout ratio, no gradient.
    if cfg.correction.is_on() {
        let lengths: Vec<usize> = seqs.iter().map(|s| s.num_completion_tokens()).collect();
        let (weights, sums) = cfg.correction.weights(&d, &lengths);
        mismatch.correction = sums;
        token_losses = (token_losses * Tensor::new(weights, device)?.to_dtype(dtype)?)?;
    }
    // 3. k3 KL to the reference: exp(ref - lp) - (ref - lp) - 1.
    if cfg.beta > 0.0 {
        let Some(reference) = reference else {
            candle_core::bail!("beta > 0 needs the reference policy's logprobs");
        };
        let d = (reference - logprobs)?;
        let kl = ((d.exp()? - &d)? - 1.0)?;
        token_losses = (token_losses + (kl * cfg.beta)?)?;
    }
    let loss = (token_losses * coef)?.sum_all()?;
    let num_clipped = use_unclipped
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    let num_tokens = logprobs.dim(0)?;
    Ok(BufferLoss {
        loss,
        num_tokens,
        num_clipped: num_tokens - num_clipped as usize,
        entropy_sum: 0.0,
        mismatch,
    })
}

/// The coefficient of each token loss of a sequence with `len` completion tokens.
fn agg_factor(agg: LossAgg, norm: &Normalisers, len: usize) -> f64 {
    match agg {
        LossAgg::TokenMean => 1.0 / norm.num_tokens,
        LossAgg::SeqMeanTokenMean => 1.0 / (norm.num_seqs * len as f64),
        LossAgg::SeqMeanTokenSumNorm => 1.0 / (norm.num_seqs * norm.max_len),
    }
}

/// Each token gets the mean of its sequence's values: (M,) -> (M,), differentiable.
fn sequence_mean(x: &Tensor, seqs: &[&TrainSeq], device: &Device) -> Result<Tensor> {
    let m = x.dim(0)?;
    // (S, M): row s averages the tokens of sequence s; then each token reads its row.
    let mut avg = vec![0f32; seqs.len() * m];
    let mut owner = Vec::with_capacity(m);
    let mut start = 0;
    for (i, s) in seqs.iter().enumerate() {
        let len = s.num_completion_tokens();
        avg[i * m + start..i * m + start + len].fill(1.0 / len as f32);
        owner.extend(std::iter::repeat_n(i as u32, len));
        start += len;
    }
    let avg = Tensor::from_vec(avg, (seqs.len(), m), device)?.to_dtype(x.dtype())?;
    let means = avg.matmul(&x.unsqueeze(1)?)?.squeeze(1)?;
    means.index_select(&Tensor::from_vec(owner, m, device)?, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    /// Two sequences: A (+1 advantage, weight 2) and B (-0.5, weight 1). Log-ratios put
    /// tokens on both clip sides: A0 clipped high, A1 inside, B0 clipped low, B1 inside,
    /// B2 above the range but unclipped (negative advantage takes the smaller term).
    const LOG_RATIOS: [f64; 5] = [0.5, -0.1, -0.5, 0.2, 0.4];
    const OLD: [f32; 5] = [-1.0, -2.0, -0.5, -3.0, -1.5];
    const REF: [f32; 5] = [-1.2, -1.9, -0.7, -2.5, -1.0];

    fn seqs() -> Vec<TrainSeq> {
        let make = |n: usize, adv: f64, weight: f64, off: usize| TrainSeq {
            tokens: vec![0; 1 + n],
            num_prompt_tokens: 1,
            advantage: adv,
            weight,
            rollout_logprobs: OLD[off..off + n].to_vec(),
        };
        vec![make(2, 1.0, 2.0, 0), make(3, -0.5, 1.0, 2)]
    }

    /// Independent f64 computation: (loss, d loss / d logprob per token, clipped tokens).
    fn by_hand(cfg: &LossConfig, norm: &Normalisers) -> (f64, Vec<f64>, usize) {
        let owner = [0usize, 0, 1, 1, 1];
        let (adv, weight, len) = ([1.0, -0.5], [2.0, 1.0], [2.0, 3.0]);
        let lp: Vec<f64> = (0..5).map(|t| OLD[t] as f64 + LOG_RATIOS[t]).collect();
        let seq_mean = |s: usize| {
            (0..5)
                .filter(|&t| owner[t] == s)
                .map(|t| LOG_RATIOS[t])
                .sum::<f64>()
                / len[s]
        };
        let (mut loss, mut grad, mut clipped) = (0.0, vec![0.0; 5], 0);
        for t in 0..5 {
            let s = owner[t];
            let coef = weight[s]
                * match cfg.loss_agg {
                    LossAgg::TokenMean => 1.0 / norm.num_tokens,
                    LossAgg::SeqMeanTokenMean => 1.0 / (norm.num_seqs * len[s]),
                    LossAgg::SeqMeanTokenSumNorm => 1.0 / (norm.num_seqs * norm.max_len),
                };
            let log_ratio = match cfg.ratio_level {
                RatioLevel::Token => LOG_RATIOS[t],
                RatioLevel::Sequence => seq_mean(s),
            };
            let rho = log_ratio.exp();
            let unclipped = rho * adv[s];
            let clip = rho.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high) * adv[s];
            let is_unclipped = unclipped <= clip;
            loss -= coef * unclipped.min(clip);
            clipped += usize::from(!is_unclipped);
            if is_unclipped {
                match cfg.ratio_level {
                    RatioLevel::Token => grad[t] -= coef * adv[s] * rho,
                    RatioLevel::Sequence => {
                        for u in (0..5).filter(|&u| owner[u] == s) {
                            grad[u] -= coef * adv[s] * rho / len[s];
                        }
                    }
                }
            }
            let d = REF[t] as f64 - lp[t];
            loss += coef * cfg.beta * (d.exp() - d - 1.0);
            grad[t] += coef * cfg.beta * (1.0 - d.exp());
        }
        (loss, grad, clipped)
    }

    #[test]
    fn loss_and_gradient_match_a_hand_computation() {
        let norm = Normalisers {
            num_seqs: 4.0,
            num_tokens: 10.0,
            max_len: 8.0,
        };
        let owned = seqs();
        let refs: Vec<&TrainSeq> = owned.iter().collect();
        for loss_agg in [
            LossAgg::TokenMean,
            LossAgg::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSumNorm,
        ] {
            for ratio_level in [RatioLevel::Token, RatioLevel::Sequence] {
                for beta in [0.0, 0.1] {
                    let cfg = LossConfig {
                        eps_low: 0.2,
                        eps_high: 0.3,
                        loss_agg,
                        ratio_level,
                        beta,
                        temperature: 1.0,
                        top_p: 1.0,
                        recompute_old_logprobs: false,
                        correction: RolloutCorrection::default(),
                    };
                    let lp: Vec<f64> = (0..5).map(|t| OLD[t] as f64 + LOG_RATIOS[t]).collect();
                    let lp = Var::new(lp, &Device::Cpu).unwrap();
                    let reference: Vec<f64> = REF.iter().map(|&x| x as f64).collect();
                    let reference = Tensor::new(reference, &Device::Cpu).unwrap();
                    let out =
                        token_loss(lp.as_tensor(), Some(&reference), &refs, &cfg, &norm).unwrap();
                    let (want, want_grad, want_clipped) = by_hand(&cfg, &norm);
                    let got = out.loss.to_scalar::<f64>().unwrap();
                    assert!((got - want).abs() < 1e-6, "{cfg:?}: loss {got} vs {want}");
                    let grad = out.loss.backward().unwrap();
                    let grad = grad.get(&lp).unwrap().to_vec1::<f64>().unwrap();
                    for (g, w) in grad.iter().zip(&want_grad) {
                        assert!(
                            (g - w).abs() < 1e-6,
                            "{cfg:?}: grad {grad:?} vs {want_grad:?}"
                        );
                    }
                    assert_eq!(out.num_clipped, want_clipped, "{cfg:?}");
                }
            }
        }
    }
}
