//! Bar charts of benchmark results as SVG (plotters): one panel per measure, one group of
//! bars per workload, one bar per mode.

use std::path::Path;

use plotters::prelude::*;

/// One panel: a measure's title and its value per (workload, mode).
pub struct Panel<'a> {
    pub title: &'a str,
    pub values: Vec<Vec<f64>>,
}

const COLOURS: [RGBColor; 6] = [
    RGBColor(90, 90, 90),
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
];

/// Empty room at the right of each panel, as a share of the bars' width, where the legend
/// goes, so it hides no bar.
const LEGEND_ROOM: f64 = 0.2;

/// Writes grouped bar charts: `groups` (workloads) × `series` (modes) per panel, creating
/// `path`'s folder if need be.
pub fn grouped_bars(
    path: &Path,
    groups: &[String],
    series: &[String],
    panels: &[Panel],
) -> anyhow::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let height = 360 * panels.len() as u32;
    let root = SVGBackend::new(path, (960, height)).into_drawing_area();
    root.fill(&WHITE)?;
    let areas = root.split_evenly((panels.len(), 1));
    let per_group = series.len() as f64 + 1.0;
    for (area, panel) in areas.iter().zip(panels) {
        let top = panel
            .values
            .iter()
            .flatten()
            .copied()
            .fold(0.0f64, f64::max)
            .max(1e-9)
            * 1.15;
        let mut chart = ChartBuilder::on(area)
            .caption(panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(
                0.0..groups.len() as f64 * per_group * (1.0 + LEGEND_ROOM),
                0.0..top,
            )?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .y_desc(panel.title)
            .draw()?;
        for (g, group) in groups.iter().enumerate() {
            let x0 = g as f64 * per_group + 0.5;
            for (s, name) in series.iter().enumerate() {
                let value = panel.values.get(g).and_then(|v| v.get(s)).copied().unwrap_or(0.0);
                let colour = COLOURS[s % COLOURS.len()];
                let bar = chart.draw_series(std::iter::once(Rectangle::new(
                    [(x0 + s as f64, 0.0), (x0 + s as f64 + 0.9, value)],
                    colour.filled(),
                )))?;
                if g == 0 {
                    bar.label(name.as_str())
                        .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled()));
                }
            }
            chart.draw_series(std::iter::once(Text::new(
                group.clone(),
                (x0, -top * 0.06),
                ("sans-serif", 14).into_font(),
            )))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_an_svg_with_every_label() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("plot.svg");
        let groups = vec!["code-edit".to_string(), "chat".to_string()];
        let series = vec!["plain".to_string(), "adaptive".to_string()];
        let panels = [Panel {
            title: "decode tok/s",
            values: vec![vec![70.0, 90.0], vec![70.0, 68.0]],
        }];
        grouped_bars(&path, &groups, &series, &panels).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in ["code-edit", "chat", "plain", "adaptive", "decode tok/s"] {
            assert!(svg.contains(text), "{text} missing");
        }
        assert!(svg.matches("<rect").count() >= 4, "four bars");
    }
}
