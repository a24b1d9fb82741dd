use kiln::export::writer::{
    Dtype, Encoded, LinearWeight, OutputWriter, WriterEnd, WriterType, Written,
};
use kiln::{ExportError, writer};

#[derive(Default)]
struct NotAReader;

#[writer(name = "mine", reader = NotAReader)]
struct Mine;

impl OutputWriter for Mine {
    fn linear(&self, _: &LinearWeight<'_>) -> Result<Written, ExportError> {
        Ok(Written::default())
    }
    fn tensor(&self, n: &str, d: Dtype, s: &[usize], b: Vec<u8>) -> Result<Written, ExportError> {
        Ok(Written::copied(n, d, s, b))
    }
    fn write(&mut self, _: Encoded) -> Result<(), ExportError> {
        Ok(())
    }
    fn finish(&mut self, _: &WriterEnd<'_>) -> Result<Vec<String>, ExportError> {
        Ok(Vec::new())
    }
}

impl WriterType for Mine {
    fn formats() -> Vec<(&'static str, String)> {
        vec![("x", "x".into())]
    }
    fn new(_: &str) -> Result<Self, ExportError> {
        Ok(Mine)
    }
}

fn main() {}
