use kiln::{exporter, ModuleExporter};

struct Plain;

#[exporter(keys = ["Linear"], replaces = Plain)]
struct Replacer;
impl ModuleExporter for Replacer {}

fn main() {}
