//! Table configuration and validation.

use std::fmt;

#[derive(Debug)]
pub enum StoreError {
    /// Bad argument value (maps to Python ValueError).
    Value(String),
    /// Wrong type / dtype (maps to Python TypeError).
    Type(String),
    /// Unknown table (maps to Python KeyError).
    Key(String),
    /// I/O error (maps to Python OSError).
    Io(std::io::Error),
    /// Corrupted or incompatible snapshot (maps to Python ValueError).
    Corrupt(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Value(s) | StoreError::Type(s) | StoreError::Key(s) => f.write_str(s),
            StoreError::Io(e) => write!(f, "I/O error: {e}"),
            StoreError::Corrupt(s) => write!(f, "corrupted or incompatible snapshot: {s}"),
        }
    }
}

impl std::error::Error for StoreError {}

impl From<std::io::Error> for StoreError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            StoreError::Corrupt("file is truncated".into())
        } else {
            StoreError::Io(e)
        }
    }
}

pub type Result<T> = std::result::Result<T, StoreError>;

pub fn value_err<T>(msg: impl Into<String>) -> Result<T> {
    Err(StoreError::Value(msg.into()))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
}

impl DType {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "fp32" | "float32" | "f32" => Ok(DType::F32),
            "fp16" | "float16" | "f16" | "half" => Ok(DType::F16),
            "bf16" | "bfloat16" => Ok(DType::BF16),
            _ => value_err(format!("unknown dtype {s:?}: expected one of 'fp32', 'fp16', 'bf16'")),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "fp32",
            DType::F16 => "fp16",
            DType::BF16 => "bf16",
        }
    }
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            _ => 2,
        }
    }
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(DType::F32),
            1 => Some(DType::F16),
            2 => Some(DType::BF16),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InitKind {
    Uniform = 0,
    Normal = 1,
}

impl InitKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "uniform" => Ok(InitKind::Uniform),
            "normal" | "gaussian" => Ok(InitKind::Normal),
            _ => value_err(format!("unknown initializer {s:?}: expected 'uniform' or 'normal'")),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            InitKind::Uniform => "uniform",
            InitKind::Normal => "normal",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OptKind {
    Sgd = 0,
    Adagrad = 1,
    RowwiseAdagrad = 2,
    Adam = 3,
    Ftrl = 4,
}

impl OptKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "sgd" => Ok(OptKind::Sgd),
            "adagrad" => Ok(OptKind::Adagrad),
            "rowwise_adagrad" => Ok(OptKind::RowwiseAdagrad),
            "adam" => Ok(OptKind::Adam),
            "ftrl" => Ok(OptKind::Ftrl),
            _ => value_err(format!(
                "unknown optimizer {s:?}: expected one of 'sgd', 'adagrad', 'rowwise_adagrad', 'adam', 'ftrl'"
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            OptKind::Sgd => "sgd",
            OptKind::Adagrad => "adagrad",
            OptKind::RowwiseAdagrad => "rowwise_adagrad",
            OptKind::Adam => "adam",
            OptKind::Ftrl => "ftrl",
        }
    }
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => OptKind::Sgd,
            1 => OptKind::Adagrad,
            2 => OptKind::RowwiseAdagrad,
            3 => OptKind::Adam,
            4 => OptKind::Ftrl,
            _ => return None,
        })
    }
    /// Number of f32 optimizer-state values per element of the row.
    pub fn state_per_elem(self) -> usize {
        match self {
            OptKind::Sgd | OptKind::RowwiseAdagrad => 0,
            OptKind::Adagrad => 1,
            OptKind::Adam | OptKind::Ftrl => 2,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionKind {
    Off = 0,
    Probability = 1,
    Threshold = 2,
}

impl AdmissionKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "off" | "none" => Ok(AdmissionKind::Off),
            "probability" => Ok(AdmissionKind::Probability),
            "threshold" => Ok(AdmissionKind::Threshold),
            _ => {
                value_err(format!("unknown admission policy {s:?}: expected one of 'off', 'probability', 'threshold'"))
            }
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            AdmissionKind::Off => "off",
            AdmissionKind::Probability => "probability",
            AdmissionKind::Threshold => "threshold",
        }
    }
}

/// Full configuration of a table. Hyper-parameters are kept as f64 for exact
/// round trips; arithmetic is done in f32 (bias corrections in f64).
#[derive(Clone, Debug, PartialEq)]
pub struct TableConfig {
    pub name: String,
    pub dim: usize,
    pub dtype: DType,
    pub initializer: InitKind,
    pub init_low: f64,
    pub init_high: f64,
    pub init_mean: f64,
    pub init_std: f64,
    pub seed: u64,
    pub optimizer: OptKind,
    pub lr: f64,
    pub weight_decay: f64,
    pub eps: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub initial_accumulator: f64,
    pub ftrl_alpha: f64,
    pub ftrl_beta: f64,
    pub ftrl_l1: f64,
    pub ftrl_l2: f64,
    pub weight_bound: Option<f64>,
    pub admission: AdmissionKind,
    pub admission_probability: f64,
    pub admission_threshold: u32,
    pub sketch_width: u32,
    pub sketch_depth: u32,
    pub capacity: Option<u64>,
    pub ttl_seconds: Option<u64>,
    pub ttl_updates: Option<u64>,
    /// RAM budget of the table's rows in bytes (with `disk`): the least recently used rows
    /// beyond it live in `disk` (see table/spill.rs). Not part of snapshots.
    pub memory_budget_bytes: Option<u64>,
    /// Directory of the table's spill files (with `memory_budget_bytes`).
    pub disk: Option<String>,
}

pub const MAX_DIM: usize = 1 << 16;

impl TableConfig {
    pub fn new(name: &str, dim: usize) -> Self {
        TableConfig {
            name: name.to_string(),
            dim,
            dtype: DType::F32,
            initializer: InitKind::Uniform,
            init_low: -0.01,
            init_high: 0.01,
            init_mean: 0.0,
            init_std: 0.01,
            seed: 0,
            optimizer: OptKind::Sgd,
            lr: 0.01,
            weight_decay: 0.0,
            eps: 1e-8,
            beta1: 0.9,
            beta2: 0.999,
            initial_accumulator: 0.0,
            ftrl_alpha: 0.05,
            ftrl_beta: 1.0,
            ftrl_l1: 0.0,
            ftrl_l2: 0.0,
            weight_bound: None,
            admission: AdmissionKind::Off,
            admission_probability: 1.0,
            admission_threshold: 0,
            sketch_width: 1 << 20,
            sketch_depth: 4,
            capacity: None,
            ttl_seconds: None,
            ttl_updates: None,
            memory_budget_bytes: None,
            disk: None,
        }
    }

    pub fn validate(&self) -> Result<()> {
        fn finite(name: &str, v: f64) -> Result<()> {
            if v.is_finite() {
                Ok(())
            } else {
                value_err(format!("{name} must be finite, got {v}"))
            }
        }
        if self.name.is_empty() {
            return value_err("table name must not be empty");
        }
        if self.name.len() > u16::MAX as usize {
            return value_err("table name is too long (max 65535 bytes)");
        }
        if self.dim == 0 {
            return value_err("dim must be >= 1, got 0");
        }
        if self.dim > MAX_DIM {
            return value_err(format!("dim must be <= {MAX_DIM}, got {}", self.dim));
        }
        for (n, v) in [
            ("init_low", self.init_low),
            ("init_high", self.init_high),
            ("init_mean", self.init_mean),
            ("init_std", self.init_std),
            ("lr", self.lr),
            ("weight_decay", self.weight_decay),
            ("eps", self.eps),
            ("beta1", self.beta1),
            ("beta2", self.beta2),
            ("initial_accumulator", self.initial_accumulator),
            ("ftrl_alpha", self.ftrl_alpha),
            ("ftrl_beta", self.ftrl_beta),
            ("ftrl_l1", self.ftrl_l1),
            ("ftrl_l2", self.ftrl_l2),
        ] {
            finite(n, v)?;
        }
        if self.init_low > self.init_high {
            return value_err(format!("init_low ({}) must be <= init_high ({})", self.init_low, self.init_high));
        }
        if self.init_std < 0.0 {
            return value_err(format!("init_std must be >= 0, got {}", self.init_std));
        }
        if self.lr < 0.0 {
            return value_err(format!("lr must be >= 0, got {}", self.lr));
        }
        if self.weight_decay < 0.0 {
            return value_err(format!("weight_decay must be >= 0, got {}", self.weight_decay));
        }
        if self.eps <= 0.0 {
            return value_err(format!("eps must be > 0, got {}", self.eps));
        }
        if !(0.0..1.0).contains(&self.beta1) {
            return value_err(format!("beta1 must be in [0, 1), got {}", self.beta1));
        }
        if !(0.0..1.0).contains(&self.beta2) {
            return value_err(format!("beta2 must be in [0, 1), got {}", self.beta2));
        }
        if self.initial_accumulator < 0.0 {
            return value_err(format!("initial_accumulator must be >= 0, got {}", self.initial_accumulator));
        }
        if self.optimizer == OptKind::Ftrl {
            if self.ftrl_alpha <= 0.0 {
                return value_err(format!("ftrl_alpha must be > 0, got {}", self.ftrl_alpha));
            }
            if self.ftrl_beta < 0.0 || self.ftrl_l1 < 0.0 || self.ftrl_l2 < 0.0 {
                return value_err("ftrl_beta, ftrl_l1 and ftrl_l2 must be >= 0");
            }
            if self.weight_decay != 0.0 {
                return value_err("weight_decay is not supported with optimizer='ftrl'; use ftrl_l2 instead");
            }
        }
        if let Some(b) = self.weight_bound {
            if !(b.is_finite() && b > 0.0) {
                return value_err(format!("weight_bound must be a finite number > 0, got {b}"));
            }
        }
        match self.admission {
            AdmissionKind::Off => {}
            AdmissionKind::Probability => {
                if !(0.0..=1.0).contains(&self.admission_probability) {
                    return value_err(format!(
                        "admission_probability must be in [0, 1], got {}",
                        self.admission_probability
                    ));
                }
            }
            AdmissionKind::Threshold => {
                if self.admission_threshold < 1 {
                    return value_err("admission='threshold' requires admission_threshold >= 1");
                }
                if !self.sketch_width.is_power_of_two() || self.sketch_width < 64 {
                    return value_err(format!(
                        "admission_sketch_width must be a power of two >= 64, got {}",
                        self.sketch_width
                    ));
                }
                if self.sketch_width > (1 << 28) {
                    return value_err("admission_sketch_width must be <= 2**28");
                }
                if !(1..=16).contains(&self.sketch_depth) {
                    return value_err(format!("admission_sketch_depth must be in [1, 16], got {}", self.sketch_depth));
                }
            }
        }
        if let Some(c) = self.capacity {
            if c == 0 {
                return value_err("capacity must be >= 1 (or None for unbounded)");
            }
        }
        if let Some(t) = self.ttl_seconds {
            if t == 0 || t > u32::MAX as u64 / 2 {
                return value_err(format!("ttl_seconds must be in [1, 2**31), got {t}"));
            }
        }
        if let Some(t) = self.ttl_updates {
            if t == 0 || t > (1u64 << 31) {
                return value_err(format!("ttl_updates must be in [1, 2**31], got {t}"));
            }
        }
        match (&self.memory_budget_bytes, &self.disk) {
            (Some(_), None) => return value_err("memory_budget_bytes needs disk (a directory for the rows beyond it)"),
            (None, Some(_)) => return value_err("disk needs memory_budget_bytes (the RAM kept for the hot rows)"),
            (_, Some(d)) if d.is_empty() => return value_err("disk must be a directory path, got an empty string"),
            _ => {}
        }
        Ok(())
    }

    pub fn state_dim(&self) -> usize {
        self.optimizer.state_per_elem() * self.dim
    }
    pub fn has_row_acc(&self) -> bool {
        self.optimizer == OptKind::RowwiseAdagrad
    }
    pub fn has_steps(&self) -> bool {
        self.optimizer == OptKind::Adam
    }
    /// LRU ticks: for capacity eviction, and for choosing the rows a disk tier spills.
    pub fn has_lru(&self) -> bool {
        self.capacity.is_some() || self.disk.is_some()
    }
    pub fn has_disk_tier(&self) -> bool {
        self.disk.is_some()
    }
    pub fn has_utime(&self) -> bool {
        self.ttl_seconds.is_some()
    }
    pub fn has_utick(&self) -> bool {
        self.ttl_updates.is_some()
    }
}
