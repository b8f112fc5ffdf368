//! The table metadata block: the table's configuration and counters.

use super::corrupt;
use crate::config::*;
use crate::table::COUNTER_NAMES;

struct Enc(Vec<u8>);
impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v)
    }
    fn u16(&mut self, v: u16) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn f64(&mut self, v: f64) {
        self.0.extend_from_slice(&v.to_le_bytes())
    }
    fn opt_u64(&mut self, v: Option<u64>) {
        self.u8(v.is_some() as u8);
        self.u64(v.unwrap_or(0));
    }
}

struct Dec<'a>(&'a [u8]);
impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        if self.0.len() < n {
            return corrupt("table metadata block is too short");
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().unwrap_or_default()))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap_or_default()))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn f64(&mut self) -> Result<f64> {
        Ok(f64::from_le_bytes(self.take(8)?.try_into().unwrap_or_default()))
    }
    fn opt_u64(&mut self) -> Result<Option<u64>> {
        let has = self.u8()?;
        let v = self.u64()?;
        Ok(if has != 0 { Some(v) } else { None })
    }
}

pub(super) fn encode_meta(cfg: &TableConfig, counters: &[u64; 9]) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(512));
    e.u16(cfg.name.len() as u16);
    e.0.extend_from_slice(cfg.name.as_bytes());
    e.u32(cfg.dim as u32);
    e.u8(cfg.dtype as u8);
    e.u8(cfg.initializer as u8);
    for v in [cfg.init_low, cfg.init_high, cfg.init_mean, cfg.init_std] {
        e.f64(v);
    }
    e.u64(cfg.seed);
    e.u8(cfg.optimizer as u8);
    for v in [
        cfg.lr,
        cfg.weight_decay,
        cfg.eps,
        cfg.beta1,
        cfg.beta2,
        cfg.initial_accumulator,
        cfg.ftrl_alpha,
        cfg.ftrl_beta,
        cfg.ftrl_l1,
        cfg.ftrl_l2,
    ] {
        e.f64(v);
    }
    e.u8(cfg.weight_bound.is_some() as u8);
    e.f64(cfg.weight_bound.unwrap_or(0.0));
    e.u8(cfg.admission as u8);
    e.f64(cfg.admission_probability);
    e.u32(cfg.admission_threshold);
    e.u32(cfg.sketch_width);
    e.u32(cfg.sketch_depth);
    e.opt_u64(cfg.capacity);
    e.opt_u64(cfg.ttl_seconds);
    e.opt_u64(cfg.ttl_updates);
    e.u32(COUNTER_NAMES.len() as u32);
    for c in counters {
        e.u64(*c);
    }
    e.0
}

pub(super) fn decode_meta(b: &[u8]) -> Result<(TableConfig, [u64; 9])> {
    let mut d = Dec(b);
    let nlen = d.u16()? as usize;
    let name = std::str::from_utf8(d.take(nlen)?)
        .map_err(|_| StoreError::Corrupt("table name is not valid UTF-8".into()))?
        .to_string();
    let mut c = TableConfig::new(&name, 1);
    c.dim = d.u32()? as usize;
    c.dtype = DType::from_u8(d.u8()?).ok_or_else(|| StoreError::Corrupt("bad dtype code".into()))?;
    c.initializer = match d.u8()? {
        0 => InitKind::Uniform,
        1 => InitKind::Normal,
        _ => return corrupt("bad initializer code"),
    };
    c.init_low = d.f64()?;
    c.init_high = d.f64()?;
    c.init_mean = d.f64()?;
    c.init_std = d.f64()?;
    c.seed = d.u64()?;
    c.optimizer = OptKind::from_u8(d.u8()?).ok_or_else(|| StoreError::Corrupt("bad optimizer code".into()))?;
    c.lr = d.f64()?;
    c.weight_decay = d.f64()?;
    c.eps = d.f64()?;
    c.beta1 = d.f64()?;
    c.beta2 = d.f64()?;
    c.initial_accumulator = d.f64()?;
    c.ftrl_alpha = d.f64()?;
    c.ftrl_beta = d.f64()?;
    c.ftrl_l1 = d.f64()?;
    c.ftrl_l2 = d.f64()?;
    let has_b = d.u8()?;
    let b = d.f64()?;
    c.weight_bound = if has_b != 0 { Some(b) } else { None };
    c.admission = match d.u8()? {
        0 => AdmissionKind::Off,
        1 => AdmissionKind::Probability,
        2 => AdmissionKind::Threshold,
        _ => return corrupt("bad admission code"),
    };
    c.admission_probability = d.f64()?;
    c.admission_threshold = d.u32()?;
    c.sketch_width = d.u32()?;
    c.sketch_depth = d.u32()?;
    c.capacity = d.opt_u64()?;
    c.ttl_seconds = d.opt_u64()?;
    c.ttl_updates = d.opt_u64()?;
    let nc = d.u32()? as usize;
    if nc != COUNTER_NAMES.len() {
        return corrupt("unexpected number of counters");
    }
    let mut counters = [0u64; 9];
    for x in counters.iter_mut() {
        *x = d.u64()?;
    }
    if !d.0.is_empty() {
        return corrupt("trailing bytes in table metadata block");
    }
    c.validate().map_err(|e| StoreError::Corrupt(format!("invalid table configuration: {e}")))?;
    Ok((c, counters))
}
